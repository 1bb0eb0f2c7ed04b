"""GGUF tensors (Q4_K, Q5_K, Q6_K and the legacy Q4/Q5/Q8 types), repacked once at load into the
tiles that kernels/kquant.c (AVX-512 VNNI, else AVX2) multiplies several rows through at once.

Knows: the kernel's build (system C compiler, cached per machine like w4a8's) and calls
through ctypes. Must not know: models, GGUF parsing (the caller hands over a tensor's stored
bytes), sessions.

Why: ggml's dot products (ggml.py) read one activation row per call, so a verify block of 8
rows costs about 8 one-row unpackings of every weight; this kernel unpacks a tile once per 4
rows. The values are the file's own (float32 products of its fp16 and 6-bit scales), so
repacking changes the layout only.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import numpy as np
import torch

from backends.cbuild import build, compiler, loads
from backends.cpu import kernel_isa

_SOURCE = Path(__file__).parent / "kernels" / "kquant.c"
_ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c")}
Q4_K, Q5_K, Q6_K = 12, 13, 14
K_QUANTS = frozenset({Q4_K, Q5_K, Q6_K})  # blocks of 256; the legacy types' are of 32
TYPES = frozenset({2, 3, 6, 7, 8, *K_QUANTS})  # plus Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
TILE, SUPER, GROUP, MAX_ROWS = 16, 256, 32, 16


@functools.cache
def _library() -> ctypes.CDLL:
    isa = kernel_isa()
    if isa is None:
        raise OSError("kquant needs AVX-512 VNNI or AVX2")
    library = build("kquant", _SOURCE, ("-O3", "-fPIC", "-shared", "-fopenmp", *_ISA_FLAGS[isa]))
    p, i = ctypes.c_void_p, ctypes.c_int
    library.kq_packed_bytes.argtypes = [i, i, i]
    library.kq_packed_bytes.restype = ctypes.c_size_t
    library.kq_pack.argtypes = [i, p, i, i, p]
    library.kq_matmul.argtypes = [i, p, i, i, p, i, p, p, i, p]
    library.kq_matmul_parts.argtypes = [i, p, p, p, p, p, i, p, i, p, i, p]
    return library


@functools.cache
def is_available() -> bool:
    """Whether the kernel builds and runs here (AVX-512 VNNI or AVX2, and a C compiler)."""
    return kernel_isa() is not None and compiler() is not None and loads(_library)


def can_take(ggml_type: int, out_features: int, in_features: int) -> bool:
    block = SUPER if ggml_type in K_QUANTS else GROUP
    return (ggml_type in TYPES and out_features % TILE == 0 and in_features % block == 0
            and is_available())


def pack(ggml_type: int, stored: np.ndarray, out_features: int, in_features: int) -> np.ndarray:
    """The kernel's tiles of a tensor given as its stored bytes (rows of blocks)."""
    library = _library()
    packed = np.empty(library.kq_packed_bytes(ggml_type, out_features, in_features), np.uint8)
    source = np.ascontiguousarray(stored)
    if library.kq_pack(ggml_type, source.ctypes.data, out_features, in_features,
                       packed.ctypes.data) != 0:
        raise ValueError(f"kquant cannot pack a {out_features}x{in_features} tensor")
    return packed


def matmul_at(ggml_type: int, packed: int, out_features: int, x: torch.Tensor,
              bias: torch.Tensor | None, out: torch.Tensor, column: int) -> None:
    """out[:, column:column+out_features] = x (float32 [rows, in], contiguous) times the
    packed weight at address `packed` (pack()'s array's `ctypes.data`, read once by the
    caller): a decode step makes about 200 of these calls, so each does only the call."""
    rows, in_features = x.shape
    library = _library()
    scratch = _scratch(in_features)
    stride = out.shape[1]
    bias_at = 0 if bias is None else bias.data_ptr()
    for start in range(0, rows, MAX_ROWS):
        target = out.data_ptr() + 4 * (start * stride + column)
        status = library.kq_matmul(ggml_type, packed, out_features, in_features,
                                   x.data_ptr() + 4 * start * in_features,
                                   min(MAX_ROWS, rows - start), bias_at, target, stride, scratch)
        if status != 0:
            raise ValueError(f"kquant cannot multiply {rows} rows of {in_features}")


class Parts:
    """Packed weights that read the same input, outputs side by side (a fused projection), as
    the arguments kq_matmul_parts takes: built once at load, so a call converts nothing."""

    MAX = 8

    def __init__(self, weights: list[tuple[int, int, int, torch.Tensor | None]]) -> None:
        """weights: (ggml type, packed address, output rows, float32 bias or None) per part."""
        if not 0 < len(weights) <= self.MAX:
            raise ValueError(f"kquant multiplies 1 to {self.MAX} parts at once")
        count = len(weights)
        self.count = count
        self.out_features = sum(n for _, _, n, _ in weights)
        columns = np.cumsum([0, *(n for _, _, n, _ in weights[:-1])])
        self._biases = [b for *_, b in weights]  # the addresses below point into these
        self._arrays = (
            (ctypes.c_int * count)(*(t for t, _, _, _ in weights)),
            (ctypes.c_void_p * count)(*(a for _, a, _, _ in weights)),
            (ctypes.c_int * count)(*(n for _, _, n, _ in weights)),
            (ctypes.c_void_p * count)(*(0 if b is None else b.data_ptr() for b in self._biases)),
            (ctypes.c_int * count)(*(int(c) for c in columns)))
        self.addresses = tuple(ctypes.addressof(a) for a in self._arrays)


def matmul_parts(parts: Parts, x: torch.Tensor, out: torch.Tensor) -> None:
    """out [rows, parts.out_features] = x (float32 [rows, in], contiguous) times every part,
    with the bits matmul_at gives each part alone: one call per 16 rows."""
    rows, in_features = x.shape
    library = _library()
    scratch = _scratch(in_features)
    types, weights, ns, biases, columns = parts.addresses
    for start in range(0, rows, MAX_ROWS):
        status = library.kq_matmul_parts(
            parts.count, types, weights, ns, biases, columns, in_features,
            x.data_ptr() + 4 * start * in_features, min(MAX_ROWS, rows - start),
            out.data_ptr() + 4 * start * parts.out_features, parts.out_features, scratch)
        if status != 0:
            raise ValueError(f"kquant cannot multiply {rows} rows of {in_features}")


_scratches = threading.local()  # per thread: two threads never share one buffer


def _scratch(in_features: int) -> int:
    """The address of a buffer for MAX_ROWS rows of in_features quantized activations."""
    buffers = getattr(_scratches, "buffers", None)
    if buffers is None:
        buffers = _scratches.buffers = {}
    if in_features not in buffers:
        buffers[in_features] = np.empty(MAX_ROWS * in_features
                                        + 12 * MAX_ROWS * (in_features // 32), np.uint8)
    return buffers[in_features].ctypes.data
