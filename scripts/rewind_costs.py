"""What rewinding a recurrent target costs on this CPU, two ways: the state slots specdeck keeps
(a verify forward that records the state after each row, then the crop that picks the accepted
row's) against snapshot-then-re-decode (a verify forward that records nothing, then the last
committed token and the accepted drafts decoded again from a snapshot of the state before it;
the snapshot's copy is not counted, nor the session's own bookkeeping on that side, so the
figure favours it).

    PYTHONPATH=. python scripts/rewind_costs.py [--family qwen3_5_text] [--repeats 30]

A tiny random float32 model from tests/tiny_families.py (a smoke figure: a real model's forward
is dearer, which makes the second forward of the re-decode dearer too); a 48-token prompt, then
for each k drafts and a accepted the median over `--repeats` interleaved runs, in ms.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from backends.torch import attention
from tests.tiny import VOCAB
from tests.tiny_families import tiny_family

PROMPT = [(5 + 7 * i * i) % (VOCAB - 2) + 2 for i in range(48)]


def _ids(n: int) -> list[int]:
    return [(3 + 5 * i) % (VOCAB - 2) + 2 for i in range(n)]


def _timed(run: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_5_text")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    model = tiny_family(args.family, seed=2, attention=attention.register())
    recorded = model.start()
    recorded.forward(PROMPT)

    def forward(cache: DynamicCache, ids: list[int]) -> None:
        with torch.inference_mode():
            model.hf(input_ids=torch.tensor([ids]), use_cache=True, past_key_values=cache)

    def by_slots(k: int, a: int) -> None:
        recorded.forward(_ids(k + 1), n_logits=k + 1)
        recorded.rewind(len(PROMPT) + a + 1)

    def by_redecode(k: int, a: int, verify: DynamicCache, again: DynamicCache) -> None:
        forward(verify, _ids(k + 1))
        if a < k:  # a full accept keeps the verify's own state: nothing to decode again
            forward(again, _ids(a + 1))

    snapshot = DynamicCache(config=model.hf.config)  # no past recorded: one state, not k + 1
    forward(snapshot, PROMPT)
    print("| k | a | state slots (ms) | snapshot + re-decode (ms) |")
    print("|---|---|---|---|")
    for k in (1, 2, 4, 8):
        for a in sorted({0, k // 2, k}):
            slots, redecode = [], []
            for _ in range(args.repeats):
                slots.append(_timed(by_slots, k, a))
                recorded.rewind(len(PROMPT))
                copies = copy.deepcopy(snapshot), copy.deepcopy(snapshot)
                redecode.append(_timed(by_redecode, k, a, *copies))
            print(f"| {k} | {a} | {1e3 * statistics.median(slots):.2f} | "
                  f"{1e3 * statistics.median(redecode):.2f} |")


if __name__ == "__main__":
    main()
