"""W4A8Linear: 4-bit weights times 8-bit activations, llama.cpp's arithmetic, row-invariant.

Knows: the C kernel in kernels/w4a8.c (built once per machine with the system C compiler,
loaded with ctypes), int4 codes and their bf16 scale/zero table (quant.quantize_weight_int4).
Must not know: models, sessions, drafting.

Why: torch's int4 CPU kernel dequantizes each weight to a float before multiplying, so every
extra row of a verify forward costs it nearly as much as the first (1.5B Qwen on 2 Zen 5
cores: 4 rows 74 ms, 9 rows 203 ms against 45 ms for one; on a 2-core Xeon it was
compute-bound even at one row). Quantizing each group of 32 activations to int8 turns the dot
product into exact integer multiply-adds (vpdpbusd: 16 output rows times 4 inputs an
instruction), as llama.cpp's Q4_K x Q8_K does: one row is bound by the bytes of weights read
and each further row adds a few ms (4 rows 66 ms, 9 rows 93 ms). Each row is quantized alone
and runs the same instructions whatever the row count, so a verify block gives every row its
one-row bits (checked at load like every other kernel).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from backends.cbuild import build, compiler, loads
from backends.cpu import cpu_has_w4a8
from backends.torch.quantized_linear import bf16_bias, quantize_weight_int4, rows_are_invariant

_SOURCE = Path(__file__).parent / "kernels" / "w4a8.c"
_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512vnni", "-mfma")
GROUP = 32
TILE = 16
MAX_ROWS = 16  # the kernel's rows per call; larger forwards run in calls of this many


def unavailable_reason() -> str | None:
    """Why this machine cannot run the kernel, or None."""
    if not cpu_has_w4a8():
        return "this CPU lacks AVX512-VNNI (w4a8's kernel needs it)"
    if compiler() is None:
        return "no C compiler (cc or gcc) on PATH to build the w4a8 kernel"
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    """The kernel, built on first use into the cache, named by a hash of source and flags."""
    library = build("w4a8", _SOURCE, _FLAGS, ["-lm"])
    library.w4a8_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p]
    library.w4a8_pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return library


@functools.cache
def is_available() -> bool:
    return unavailable_reason() is None and loads(_library)


@functools.cache
def is_exact(max_rows: int = MAX_ROWS) -> bool:
    """Whether the kernel builds here and gives each of up to max_rows rows the bits it gets
    alone."""
    return is_available() and rows_are_invariant(
        lambda linear: W4A8Linear.quantize(linear), max_rows)


class W4A8Linear(torch.nn.Module):
    """4-bit weights (groups of 32, bf16 scale and zero) times per-group int8 activations."""

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.packed = packed  # pack()'s layout; a plain attribute: never cast
        self.register_buffer("bias", bias)
        self.float_out = False  # float32 logits (a drafter's output layer): argmax reads them
        # 8x faster than bf16 ones

    @classmethod
    def can_take(cls, linear: torch.nn.Module) -> bool:
        return (isinstance(linear, torch.nn.Linear) and linear.in_features % GROUP == 0
                and linear.out_features % TILE == 0)

    @classmethod
    def quantize(cls, linear: torch.nn.Linear) -> W4A8Linear:
        codes, scales_zeros = quantize_weight_int4(linear.weight, GROUP)
        return cls(pack(codes, scales_zeros), *codes.shape, bf16_bias(linear))

    def packed_bytes(self) -> int:
        return self.packed.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        # bf16 in and out, the bias added in the kernel as torch's bf16 add would add it
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        out = torch.empty((rows, self.out_features), dtype=torch.bfloat16)
        for start in range(0, rows, MAX_ROWS):
            _matmul(flat[start:start + MAX_ROWS], self.packed, self.bias,
                    out[start:start + MAX_ROWS])
        out = out.float() if self.float_out else out
        return out.reshape(*x.shape[:-1], self.out_features)


def pack(codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The kernel's tiled layout of int4 codes [out, in] and their [in/32, out, 2] table.
    Tiles of 16 rows follow each other, so the packs of row blocks (multiples of 16) joined in
    order are the pack of the whole."""
    out_features, in_features = codes.shape
    codes_u8 = codes.to(torch.uint8).contiguous()
    scales = scales_zeros[..., 0].contiguous().view(torch.int16)
    zeros = scales_zeros[..., 1].contiguous().view(torch.int16)
    packed = torch.empty(out_features * in_features // 2 + 2 * scales_zeros.numel(),
                         dtype=torch.uint8)
    status = _library().w4a8_pack(codes_u8.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                                  out_features, in_features, packed.data_ptr())
    if status != 0:
        raise ValueError(f"w4a8 cannot pack a {out_features}x{in_features} weight")
    return packed


def _matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor) -> None:
    rows, in_features = x.shape
    groups = in_features // GROUP
    scratch = torch.empty(rows * in_features + 8 * rows * groups, dtype=torch.uint8)
    status = _library().w4a8_matmul(x.data_ptr(), rows, in_features, packed.data_ptr(),
                                    out.shape[1], 0 if bias is None else bias.data_ptr(),
                                    out.data_ptr(), scratch.data_ptr())
    if status != 0:
        raise ValueError(f"w4a8 cannot multiply {rows} rows of {in_features}")
