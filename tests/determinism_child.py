"""One process of test_determinism: load a tiny model in each dtype and print, as one JSON
line, the greedy tokens of a prompt asked twice and the bits of the prompt's last logits.

Run as `python -m tests.determinism_child HF_FOLDER GGUF_FILE DTYPE...`. A dtype
`gguf:ggml` is the GGUF on ggml's dot products (kquant switched off), as on a CPU without
AVX2. Knows: the torch backend and the engine. Must not know: what the test compares.
"""

from __future__ import annotations

import hashlib
import json
import sys

from app.core.engine import SpecEngine
from app.core.types import Done, SamplingParams

# over the 64 rows of a verify: a prompt this long was once prefilled in one batched call
PROMPT = [(7 * i + 3) % 45 + 2 for i in range(90)]
NEW_TOKENS = 24


def answer(engine: SpecEngine, prompt: list[int]) -> list[int]:
    done = list(engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS)))[-1]
    assert isinstance(done, Done) and done.error is None, done
    return list(done.token_ids)


def logits_digest(model, prompt: list[int], cached: int) -> str:
    """sha256 of the prompt's last logits, with its first `cached` tokens forwarded before."""
    session = model.start()
    if cached:
        session.forward(prompt[:cached], n_logits=1)
    out = session.forward(prompt[cached:], n_logits=1)
    return hashlib.sha256(out.logits_fn()[-1].tobytes()).hexdigest()[:16]


def run(folder: str, gguf: str, dtype: str) -> dict[str, object]:
    from backends.torch.backend import TorchBackend

    if dtype == "gguf:ggml":
        from backends.torch import kquant
        kquant.is_available = lambda: False
    path = gguf if dtype.startswith("gguf") else folder
    model = TorchBackend().load(path, device="cpu", dtype=dtype.split(":")[0])
    model.eos_token_ids = frozenset()
    engine = SpecEngine(model)
    first = answer(engine, PROMPT)
    return {"first": first,
            "again": answer(engine, PROMPT),  # all but its last token cached now
            "extended": answer(engine, PROMPT + first[:5]),  # the prompt and a reply cached
            "extended_cold": answer(SpecEngine(model), PROMPT + first[:5]),
            "logits_cold": logits_digest(model, PROMPT, 0),
            "logits_cached": logits_digest(model, PROMPT, len(PROMPT) - 1)}


def main(argv: list[str]) -> None:
    folder, gguf, dtypes = argv[1], argv[2], argv[3:]
    print(json.dumps({dtype: run(folder, gguf, dtype) for dtype in dtypes}))


if __name__ == "__main__":
    main(sys.argv)
