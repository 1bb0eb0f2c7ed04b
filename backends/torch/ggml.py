"""ggml's CPU dot products over a GGUF tensor's stored blocks, through a small C shim.

Knows: the shim kernels/ggml_linear.c (built once per machine against the ggml CPU library
that llama-cpp-python installs, loaded with ctypes), ggml type numbers. Must not know: models,
GGUF parsing, sessions, drafting. gguf_layers.py takes it for the types or CPUs kquant.py
cannot compute.

Why ggml: its dot products are llama.cpp's own (Q4_K, Q5_K, Q6_K times Q8_K, the legacy types
times Q8_0 / Q8_1, F16, BF16, F32), maintained for AVX2, AVX-512 and NEON; the shim calls
them one output element at a time (vec_dot over one weight row and one activation row, each
row quantized alone), so a verify block gives every row its one-row bits by construction.
The weights stay in the file's pages: nothing is dequantized or copied at load. The cost:
each extra row of a verify block unpacks every weight again.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch

from backends.cbuild import build, compiler, loads

_SOURCE = Path(__file__).parent / "kernels" / "ggml_linear.c"
_FLAGS = ("-O2", "-fPIC", "-shared", "-fopenmp")
INSTALL_HINT = ("install llama-cpp-python (`make llamacpp`, or `pip install llama-cpp-python` "
                "with the CMAKE_ARGS of scripts/llama_cmake_args.sh), whose ggml library "
                "computes on the file's own blocks")


def ggml_library_dir() -> Path | None:
    """The folder of the ggml CPU library llama-cpp-python installed, or None."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        lib = Path(root) / "lib"
        if (lib / "libggml-cpu.so").exists() and (lib / "libggml-base.so").exists():
            return lib
    return None


def unavailable_reason() -> str | None:
    """Why GGUF blocks cannot be computed on here, or None."""
    if ggml_library_dir() is None:
        return f"no ggml library: {INSTALL_HINT}"
    if compiler() is None:
        return "no C compiler (cc or gcc) on PATH to build the ggml shim"
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    """The shim, built on first use; named by a hash of its source, flags and the ggml
    library it links (a rebuilt llama-cpp-python gets a new shim)."""
    lib_dir = ggml_library_dir()
    if lib_dir is None:
        raise OSError(f"no ggml library: {INSTALL_HINT}")
    stat = (lib_dir / "libggml-cpu.so").stat()
    library = build("ggml-linear", _SOURCE, _FLAGS,
                    [f"-L{lib_dir}", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{lib_dir}"],
                    key=f"{lib_dir}{stat.st_size}{stat.st_mtime_ns}".encode())
    p, i = ctypes.c_void_p, ctypes.c_int
    library.gl_vec_dot_type.argtypes = [i]
    library.gl_row_size.argtypes = [i, ctypes.c_int64]
    library.gl_row_size.restype = ctypes.c_size_t
    library.gl_quantize.argtypes = [i, p, i, i, p]
    library.gl_matmul.argtypes = [i, p, p, i, i, p, i, p, p, i]
    library.gl_init()
    return library


@functools.cache
def is_available() -> bool:
    return unavailable_reason() is None and loads(_library)


def can_compute(ggml_type: int) -> bool:
    """Whether ggml is here and has a CPU dot product for weights of this type."""
    return is_available() and _library().gl_vec_dot_type(ggml_type) >= 0


def matmul(ggml_type: int, weight: np.ndarray, order: np.ndarray | None, out_features: int,
           x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, column: int,
           quantized: dict[int, np.ndarray]) -> None:
    """out[:, column:column+out_features] = x (float32 [rows, in]) times the stored weight's
    rows (in `order` where given); `quantized` keeps x per activation type across calls."""
    library, (rows, in_features) = _library(), x.shape
    vec_type = library.gl_vec_dot_type(ggml_type)
    q = quantized.get(vec_type)
    if q is None:
        q = quantized[vec_type] = np.empty(rows * library.gl_row_size(vec_type, in_features),
                                           np.uint8)
        _check(library.gl_quantize(vec_type, x.data_ptr(), rows, in_features, q.ctypes.data),
               "quantize")
    _check(library.gl_matmul(ggml_type, weight.ctypes.data,
                             0 if order is None else order.ctypes.data, out_features,
                             in_features, q.ctypes.data, rows,
                             0 if bias is None else bias.data_ptr(),
                             out.data_ptr() + 4 * column, out.shape[1]), "multiply")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ValueError(f"ggml cannot {what} this tensor type")


