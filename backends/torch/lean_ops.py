"""The steps between a GGUF decoder layer's matmuls, in C (kernels/lean_ops.c): RMSNorm with
the residual add, rotary embedding, the KV cache write, row-wise attention, SiLU gating.

Knows: the kernel's build (cbuild, as kquant's: AVX-512, else AVX2 with FMA) and its calls
through ctypes, float32 contiguous tensors and their addresses, how a row's visible slots are
given (a slice from slot 0, or slot indices: the prefix, then a tree row's ancestors). Must
not know: models, sessions, GGUF parsing, drafting.

Why: decoder.py's torch steps cost about 9 ms of a 42 ms one-row forward of the 1.5B Qwen on
two cores, mostly in dispatching some 30 small ops per layer. These give each row bits that
depend only on the row and the slots it sees, as the torch path's row-wise SDPA does; they
are not transformers' bits, so decoder.py takes them for GGUF models only, whose forward
has no transformers twin to match (float dtypes keep the torch steps and transformers' bits).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.cbuild import build, compiler, loads
from backends.cpu import kernel_isa

_SOURCE = Path(__file__).parent / "kernels" / "lean_ops.c"
_ISA_FLAGS = {"avx512": ("-mavx512f", "-mavx512dq", "-mfma"), "avx2": ("-mavx2", "-mfma", "-mf16c")}
WIDTH = 16  # the kernel's LANES, floats per vec (two vectors on AVX2): every width a multiple
MAX_HEAD_DIM = 256  # kernels/lean_ops.c's MAX_DIM: a head's output row stays in registers

Keys = slice | torch.Tensor  # as decoder.py names a row's visible slots


@functools.cache
def _library() -> ctypes.CDLL:
    isa = kernel_isa()
    if isa is None:
        raise OSError("lean_ops needs AVX-512 or AVX2 with FMA")
    library = build("lean_ops", _SOURCE, ("-O3", "-fPIC", "-shared", "-fopenmp", *_ISA_FLAGS[isa]),
                    link=("-lm",))
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    library.lo_rmsnorm.argtypes = [p, p, f, i, i, p]
    library.lo_add_rmsnorm.argtypes = [p, p, p, f, i, i, p, p]
    library.lo_rope.argtypes = [p, i, i, i, i, p, p]
    library.lo_store_kv.argtypes = [p, i, i, i, i, i, i, p, p, i, i]
    library.lo_attention.argtypes = [p, i, i, i, i, i, p, p, i, p, p, p, p, f, p]
    library.lo_attention.restype = i
    library.lo_silu_mul.argtypes = [p, i, i, p]
    return library


@functools.cache
def is_available() -> bool:
    """Whether the kernel builds and runs here (AVX-512 or AVX2 with FMA, and a C compiler)."""
    return kernel_isa() is not None and compiler() is not None and loads(_library)


def fits(hidden: int, intermediate: int, head_dim: int) -> bool:
    """Whether every width fills whole vectors and a head's row fits the kernel's registers."""
    return (all(w % WIDTH == 0 for w in (hidden, intermediate, head_dim))
            and head_dim <= MAX_HEAD_DIM)


@dataclass(frozen=True)
class Slots:
    """Each row's visible slots as the kernel reads them: slots start[r]..prefix[r] - 1, then
    extra[offsets[r]:offsets[r + 1]]; built once per forward, read by every layer it serves."""

    start: torch.Tensor  # int32 [rows]: 0, or where a sliding window begins
    prefix: torch.Tensor  # int32 [rows]
    offsets: torch.Tensor  # int32 [rows + 1]
    extra: torch.Tensor  # int32 [at least 1]

    @classmethod
    def of(cls, keys: Sequence[Keys] | None, first: int, rows: int) -> Slots:
        """keys as decoder.py gives them; None: causal rows, each seeing slots up to itself."""
        start, prefix, extra, offsets = [], [], [], [0]
        for r in range(rows):
            seen = slice(0, first + r + 1) if keys is None else keys[r]
            if isinstance(seen, slice):
                start.append(seen.start or 0)
                prefix.append(seen.stop)
            else:
                slots = seen.tolist()
                lead = next((j for j, s in enumerate(slots) if s != j), len(slots))
                start.append(0)
                prefix.append(lead)
                extra += slots[lead:]
            offsets.append(len(extra))
        as_int = functools.partial(torch.tensor, dtype=torch.int32)
        return cls(as_int(start), as_int(prefix), as_int(offsets), as_int(extra or [0]))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _library().lo_rmsnorm(x.data_ptr(), weight.data_ptr(), eps, x.shape[0], x.shape[1],
                          out.data_ptr())
    return out


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its norm): the residual stream and the next sublayer's input."""
    total, normed = torch.empty_like(x), torch.empty_like(x)
    _library().lo_add_rmsnorm(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps,
                              x.shape[0], x.shape[1], total.data_ptr(), normed.data_ptr())
    return total, normed


def rope(qkv: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first `heads` heads (queries, then keys) of each qkv row, in place."""
    _library().lo_rope(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], heads, dim, cos.data_ptr(),
                       sin.data_ptr())


def store_kv(qkv: torch.Tensor, k_at: int, v_at: int, kv_heads: int, dim: int,
             keys: torch.Tensor, values: torch.Tensor, first: int) -> None:
    """Each row's key and value (from columns k_at and v_at) into slots first.. of one layer's
    cache [kv_heads, capacity, dim]."""
    _library().lo_store_kv(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], k_at, v_at, kv_heads,
                           dim, keys.data_ptr(), values.data_ptr(), keys.shape[1], first)


def attention(qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, keys: torch.Tensor,
              values: torch.Tensor, slots: Slots, scale: float) -> torch.Tensor:
    """[rows, heads * dim]: each row's query heads over its slots of one layer's cache."""
    out = torch.empty((qkv.shape[0], heads * dim), dtype=torch.float32)
    status = _library().lo_attention(
        qkv.data_ptr(), qkv.shape[0], qkv.shape[1], heads, kv_heads, dim, keys.data_ptr(),
        values.data_ptr(), keys.shape[1], slots.start.data_ptr(), slots.prefix.data_ptr(),
        slots.offsets.data_ptr(), slots.extra.data_ptr(), scale, out.data_ptr())
    if status != 0:
        raise MemoryError("attention could not allocate its scores")
    return out


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    out = torch.empty((gate_up.shape[0], intermediate), dtype=torch.float32)
    _library().lo_silu_mul(gate_up.data_ptr(), gate_up.shape[0], intermediate, out.data_ptr())
    return out
