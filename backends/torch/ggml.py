"""Linear layers and embeddings that compute on a GGUF file's own blocks with ggml's kernels.

Knows: the C shim kernels/ggml_linear.c (built once per machine against the ggml CPU library
that llama-cpp-python installs, loaded with ctypes), ggml type numbers, byte views of
memory-mapped tensors (backends/gguf_tensors.py). Must not know: models' architectures,
sessions, drafting.

Why ggml: its dot products are llama.cpp's own (Q4_K, Q5_K, Q6_K times Q8_K, the legacy types
times Q8_0 / Q8_1, F16, BF16, F32), maintained for AVX2, AVX-512 and NEON; the shim calls
them one output element at a time (vec_dot over one weight row and one activation row, each
row quantized alone), so a verify block gives every row its one-row bits by construction.
The weights stay in the file's pages: nothing is dequantized or copied at load.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from backends.gguf_tensors import GgufTensors, TensorInfo
from backends.torch import kquant

_SOURCE = Path(__file__).parent / "kernels" / "ggml_linear.c"
_FLAGS = ("-O2", "-fPIC", "-shared", "-fopenmp")
F32, F16, BF16 = 0, 1, 30
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
    if _compiler() is None:
        return "no C compiler (cc or gcc) on PATH to build the ggml shim"
    return None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cache_dir() -> Path:
    # a build artifact of this machine, not user data: shared by every SPECDECK_HOME
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "specdeck" / "kernels"


@functools.cache
def _library() -> ctypes.CDLL:
    """The shim, built on first use; named by a hash of its source, flags and the ggml
    library it links (a rebuilt llama-cpp-python gets a new shim)."""
    lib_dir = ggml_library_dir()
    if lib_dir is None:
        raise OSError(f"no ggml library: {INSTALL_HINT}")
    stat = (lib_dir / "libggml-cpu.so").stat()
    key = _SOURCE.read_bytes() + f"{_FLAGS}{lib_dir}{stat.st_size}{stat.st_mtime_ns}".encode()
    target = _cache_dir() / f"ggml-linear-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([_compiler(), *_FLAGS, str(_SOURCE), "-o", str(built),
                            f"-L{lib_dir}", "-lggml-cpu", "-lggml-base",
                            f"-Wl,-rpath,{lib_dir}"], check=True, capture_output=True, text=True)
            os.replace(built, target)  # a half-written library never looks built
    library = ctypes.CDLL(str(target))
    p, i = ctypes.c_void_p, ctypes.c_int
    library.gl_vec_dot_type.argtypes = [i]
    library.gl_row_size.argtypes = [i, ctypes.c_int64]
    library.gl_row_size.restype = ctypes.c_size_t
    library.gl_quantize.argtypes = [i, p, i, i, p]
    library.gl_matmul.argtypes = [i, p, p, i, i, p, i, p, p, i]
    library.gl_rows.argtypes = [i, p, i, p, i, p]
    library.gl_init()
    return library


@functools.cache
def is_available() -> bool:
    if unavailable_reason() is not None:
        return False
    try:
        _library()
    except (OSError, subprocess.CalledProcessError):
        return False
    return True


def can_compute(ggml_type: int) -> bool:
    """Whether ggml has a CPU dot product for weights of this type."""
    return _library().gl_vec_dot_type(ggml_type) >= 0


class Part:
    """One stored weight tensor (or a row selection of it) inside a GgmlLinear: computed on
    the file's blocks by ggml, or on kquant's tiles repacked from them (`packed`)."""

    def __init__(self, data: np.ndarray, info: TensorInfo, order: np.ndarray | None = None,
                 bias: torch.Tensor | None = None, packed: np.ndarray | None = None) -> None:
        self.data, self.ggml_type, self.in_features = data, info.ggml_type, info.row_length
        self.order = None if order is None else np.ascontiguousarray(order, dtype=np.int32)
        self.out_features = info.rows if self.order is None else len(self.order)
        self.bias = None if bias is None else bias.float().contiguous()
        self.vec_type = _library().gl_vec_dot_type(self.ggml_type)
        self.packed = packed  # kquant tiles, rows in HF order; data is then never read
        self._info = info

    def rows(self, ids: np.ndarray) -> Part:
        """The part restricted to its output rows ids (on ggml: no weights copied)."""
        order = ids if self.order is None else self.order[ids]
        bias = None if self.bias is None else self.bias[torch.as_tensor(ids)]
        return Part(self.data, self._info, order, bias)

    def resident_bytes(self) -> int:
        return int(self.packed.nbytes if self.packed is not None else self.data.nbytes)


class GgmlLinear(torch.nn.Module):
    """x [..., in] float -> [..., out] float32: the parts' outputs side by side."""

    def __init__(self, parts: list[Part]) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("parts of one layer read inputs of one width")
        self.parts = parts  # plain attribute: the file's bytes are no module state
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None

    @classmethod
    def of(cls, tensors: GgufTensors, name: str, order: np.ndarray | None = None,
           bias: torch.Tensor | None = None) -> GgmlLinear:
        return cls([Part(tensors.bytes_of(name), tensors.infos[name], order, bias)])

    def rows(self, ids: torch.Tensor) -> GgmlLinear:
        """The layer restricted to output rows ids (one-part layers only)."""
        if len(self.parts) != 1:
            raise ValueError("only a one-part layer can be restricted to rows")
        return GgmlLinear([self.parts[0].rows(ids.cpu().numpy())])

    def stored_bytes(self) -> int:
        return sum(p.resident_bytes() for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        rows = flat.shape[0]
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        if rows:
            self._compute(flat, out)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _compute(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        library, rows = _library(), flat.shape[0]
        quantized: dict[int, np.ndarray] = {}
        column = 0
        for part in self.parts:
            if part.packed is not None:
                kquant.matmul(part.ggml_type, part.packed, part.out_features, flat, part.bias,
                              out, column)
                column += part.out_features
                continue
            q = quantized.get(part.vec_type)
            if q is None:
                size = library.gl_row_size(part.vec_type, self.in_features)
                q = quantized[part.vec_type] = np.empty(rows * size, dtype=np.uint8)
                _check(library.gl_quantize(part.vec_type, flat.data_ptr(), rows,
                                           self.in_features, q.ctypes.data), "quantize")
            order = 0 if part.order is None else part.order.ctypes.data
            bias = 0 if part.bias is None else part.bias.data_ptr()
            target = out.data_ptr() + 4 * column
            _check(library.gl_matmul(part.ggml_type, part.data.ctypes.data, order,
                                     part.out_features, self.in_features, q.ctypes.data, rows,
                                     bias, target, self.out_features), "multiply")
            column += part.out_features


class GgmlEmbedding(torch.nn.Module):
    """Token ids -> float32 rows of a stored table, each row dequantized when looked up."""

    def __init__(self, tensors: GgufTensors, name: str) -> None:
        super().__init__()
        self.info = tensors.infos[name]
        self.data = tensors.bytes_of(name)
        self.num_embeddings, self.embedding_dim = self.info.rows, self.info.row_length

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if self.info.ggml_type == F32:
            table = self.data.view(np.float32).reshape(self.num_embeddings, -1)
            out = torch.from_numpy(table[flat.numpy()].copy())
        else:
            out = torch.empty((flat.numel(), self.embedding_dim), dtype=torch.float32)
            _check(_library().gl_rows(self.info.ggml_type, self.data.ctypes.data,
                                      self.embedding_dim, flat.data_ptr(), flat.numel(),
                                      out.data_ptr()), "look up")
        return out.reshape(*ids.shape, self.embedding_dim)

    def stored_bytes(self) -> int:
        return int(self.data.nbytes)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ValueError(f"ggml cannot {what} this tensor type")
