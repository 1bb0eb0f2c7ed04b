"""Interleaved CPU forward costs of one model in several configurations (A B A B ..., medians).

Usage: python scripts/forward_costs.py MODEL --configs w8a8,w8a8:unfused,int4 [--rows 1-9]
       [--draft] [--rounds 7]
A configuration is a dtype, ":unfused" to load without fused projections, "gguf:ggml" to run
a GGUF on ggml's dot products only. --draft times
drafter sessions (exact=False) on 1-row forwards: ms per drafted token over 16-token runs;
otherwise it times the target's verify forwards of 1..9 rows after a 96-token prompt.
Prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import time
from unittest import mock

import torch

from backends.torch import backend as torch_backend
from backends.torch import kquant
from backends.torch.backend import TorchBackend

PROMPT_LEN, DRAFT_RUN = 96, 16


def load(path: str, config: str):
    dtype, _, option = config.partition(":")
    if option == "unfused":
        with mock.patch.object(torch_backend, "fuse_projections", lambda hf: 0):
            model = TorchBackend().load(path, device="cpu", dtype=dtype)
    elif option == "ggml":  # gguf on ggml's dot products only, none on kquant's tiles
        with mock.patch.object(kquant, "can_take", lambda *shape: False):
            model = TorchBackend().load(path, device="cpu", dtype=dtype)
    else:
        model = TorchBackend().load(path, device="cpu", dtype=dtype)
    # hand the float weights freed by quantizing back to the OS: two 1.5B models in one
    # process otherwise held 8.6 GB and were killed for memory on a 24 GB machine
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(json.dumps({"loaded": config, "dtype": model.dtype, "row_block": model.row_block}),
          flush=True)
    return model


def draft_ms(model, prompt) -> float:
    session = model.start(exact=False)
    session.forward(prompt)
    token = [prompt[-1]]
    start = time.perf_counter()
    for _ in range(DRAFT_RUN):
        token = [session.forward(token).argmax[-1]]
    return 1000 * (time.perf_counter() - start) / DRAFT_RUN


def verify_ms(session, rows: int) -> float:
    base = session.length
    start = time.perf_counter()
    session.forward(list(range(100, 100 + rows)), n_logits=rows)
    spent = time.perf_counter() - start
    session.rewind(base)
    return 1000 * spent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--configs", default="w8a8")
    parser.add_argument("--rows", default="1-9")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--draft", action="store_true")
    args = parser.parse_args()
    low, _, high = args.rows.partition("-")
    rows = range(int(low), int(high or low) + 1)
    configs = args.configs.split(",")
    models = {c: load(args.model, c) for c in configs}
    prompt = [int(t) for t in torch.randint(200, 5000, (PROMPT_LEN,),
                                            generator=torch.Generator().manual_seed(0))]
    times: dict[tuple[str, int], list[float]] = {}
    sessions = {}
    for c, model in models.items():
        if not args.draft:
            sessions[c] = model.start()
            sessions[c].forward(prompt)
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for n in ([1] if args.draft else rows):
            for c, model in models.items():
                spent = draft_ms(model, prompt) if args.draft else verify_ms(sessions[c], n)
                if round_:
                    times.setdefault((c, n), []).append(spent)
        if round_:  # partial medians, so a run cut short still reports
            print(json.dumps({"round": round_, "median_ms": {
                f"{c} x{n}": round(statistics.median(v), 1) for (c, n), v in times.items()}}),
                flush=True)
    for c, model in models.items():
        ns = [1] if args.draft else list(rows)
        print(json.dumps({
            "config": c, "dtype": model.dtype, "row_block": model.row_block,
            "kind": "draft ms/token" if args.draft else "verify ms by rows",
            "rows": ns, "median_ms": [round(statistics.median(times[(c, n)]), 1) for n in ns],
            "min_ms": [round(min(times[(c, n)]), 1) for n in ns], "rounds": args.rounds}),
            flush=True)


if __name__ == "__main__":
    main()
