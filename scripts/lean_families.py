"""Plain decoding tok/s of the lean CPU forward against transformers' forward, by family, on
tiny random float32 models (a smoke figure: the scaffolding the lean forward skips is a larger
share of a tiny step than of a real one).

    PYTHONPATH=. python scripts/lean_families.py [--families llama,qwen3,mistral,gemma3_text]

Each model is built from its transformers config (hidden 256, 4 layers, 4 heads of 64, 2 key
heads; windowed families a window of 32 under a 16-token prompt and 64 generated tokens, so
decoding runs past it), saved, and loaded by the torch backend as a user's folder would be.
The two forwards decode the same prompt in alternation, `--rounds` times; medians are
printed with each pair's ratio, and every run's tokens are checked to be the same.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from app.core.engine import SpecEngine
from app.core.types import SamplingParams
from backends.torch.backend import TorchBackend
from tests.tiny import VOCAB, tiny_tokenizer

SHAPE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=1024, eos_token_id=1, bos_token_id=0, pad_token_id=0,
             tie_word_embeddings=False)
EXTRA = {"mistral": dict(sliding_window=32),
         "gemma3_text": dict(sliding_window=32, query_pre_attn_scalar=64,
                             layer_types=["sliding_attention"] * 3 + ["full_attention"])}
PROMPT = [(3 + 7 * i * i) % (VOCAB - 2) + 2 for i in range(16)]


def _folder(family: str, root: Path) -> Path:
    torch.manual_seed(2)
    config = AutoConfig.for_model(family, **SHAPE, **EXTRA.get(family, {}))
    hf = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)  # varied greedy tokens from random weights
    hf.save_pretrained(root / family)
    tiny_tokenizer().save_pretrained(root / family)
    return root / family


def _decode(model, tokens: int) -> tuple[float, tuple[int, ...]]:
    params = SamplingParams(max_new_tokens=tokens)
    start = time.perf_counter()
    done = list(SpecEngine(model).generate(PROMPT, params))[-1]
    return len(done.token_ids) / (time.perf_counter() - start), tuple(done.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llama,qwen3,mistral,gemma3_text")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print("| family | lean tok/s | transformers' forward tok/s | ratio |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for family in args.families.split(","):
            model = TorchBackend().load(str(_folder(family, Path(root))), device="cpu",
                                        dtype="float32")
            model.eos_token_ids = frozenset()
            lean, speeds, outputs = model.lean, {"lean": [], "hf": []}, set()
            if lean is None:
                raise SystemExit(f"{family}: the lean forward does not cover it")
            _decode(model, 8)  # warm both paths once
            for _ in range(args.rounds):
                for mode in ("lean", "hf"):
                    model.lean = lean if mode == "lean" else None
                    rate, tokens = _decode(model, args.tokens)
                    speeds[mode].append(rate)
                    outputs.add(tokens)
            if len(outputs) != 1:
                raise SystemExit(f"{family}: the two forwards decoded different tokens")
            a, b = (statistics.median(speeds[m]) for m in ("lean", "hf"))
            print(f"| {family} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
