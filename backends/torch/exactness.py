"""The load-time check that makes low-precision CPU verification lossless: which row counts
give every row of a matmul the bits it gets when computed alone.

Knows: torch modules and CPU kernels. Must not know: caches, drafting, the engine.

Why: plain decoding computes one row per forward (padded to min_rows), a verify forward up to
k + 1 rows, and oneDNN picks its blocking from the row count: bf16 on one AVX512-BF16 Xeon
agreed for 2-15 rows and not at 17, which made k >= 16 decode differently from plain. So the
session splits a verify into blocks of the largest size checked here, on this CPU, with the
model's own layers (their kernels, shapes and, for int8 modes, their quantization).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

MAX_BLOCK = 16  # block sizes checked at load; larger verifies are split into such blocks


def exact_row_block(layers: Iterable[torch.nn.Module], min_rows: int, dtype: torch.dtype,
                    max_block: int = MAX_BLOCK) -> int:
    """The largest n <= max_block such that every m in min_rows..n rows gives each row, in
    each layer, exactly its result alone (padded to min_rows). At least min_rows."""
    generator = torch.Generator().manual_seed(0)
    block = max_block
    for layer in layers:
        x = torch.randn((max_block, _in_features(layer)), generator=generator).to(dtype)
        alone = [_alone(layer, x[i], min_rows) for i in range(max_block)]
        for m in range(max(min_rows, 2), block + 1):
            with torch.inference_mode():
                out = layer(x[:m])
            if not all(torch.equal(out[i], alone[i]) for i in range(m)):
                block = m - 1
                break
    return max(block, min_rows)


def _alone(layer: torch.nn.Module, row: torch.Tensor, min_rows: int) -> torch.Tensor:
    with torch.inference_mode():
        return layer(row.expand(min_rows, -1).contiguous())[0]


def _in_features(layer: torch.nn.Module) -> int:
    if hasattr(layer, "in_features"):
        return int(layer.in_features)
    raise TypeError(f"cannot check {type(layer).__name__}: it has no in_features")


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """One layer of each distinct (type, shape) among model's linear-like modules."""
    seen: dict[tuple[str, int, int], torch.nn.Module] = {}
    for module in model.modules():
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            key = (type(module).__name__, int(module.in_features), int(module.out_features))
            seen.setdefault(key, module)
    return list(seen.values())
