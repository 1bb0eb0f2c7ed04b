"""A GGUF file's tensors as they are stored: each a byte view of the memory-mapped file.

Knows: the GGUF layout after the header's key/value pairs (tensor infos: name, dimensions,
ggml type, offset; the data section at the file's alignment) and each ggml type's block size
and bytes (the gguf package's table). Must not know: what the tensors mean to a model,
backends, kernels. Nothing is copied: a view's pages are read from the file when touched, and
the operating system may drop them again, as llama.cpp's mmap does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from app.core.types import SpecdeckError
from backends.gguf_header import read_string, read_value

DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: ggml type, dims in ggml order (innermost first), byte range."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.dims[1:], dtype=np.int64)) if len(self.dims) > 1 else 1

    @property
    def row_length(self) -> int:
        return self.dims[0]

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


@dataclass(frozen=True)
class GgufTensors:
    """The tensor table of one GGUF file and a read-only map of its bytes."""

    path: Path
    architecture: str
    infos: dict[str, TensorInfo]
    data: np.memmap

    def bytes_of(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` (uint8, a view into the map: no copy)."""
        info = self.infos[name]
        return self.data[info.offset:info.offset + info.nbytes]

    def weights_bytes(self) -> int:
        return sum(info.nbytes for info in self.infos.values())


def open_tensors(path: Path) -> GgufTensors:
    """The tensor table of a GGUF file, its data memory-mapped (SpecdeckError when damaged)."""
    try:
        architecture, infos = _read_table(path)
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, struct.error, ValueError, UnicodeDecodeError, KeyError) as error:
        raise SpecdeckError(f"{path} is not a readable GGUF file ({error}); it may be cut "
                            "short or corrupt: download it again with `specdeck pull`") from error
    end = max((i.offset + i.nbytes for i in infos.values()), default=0)
    if end > len(data):
        raise SpecdeckError(f"{path} is cut short: its tensors need {end} bytes, the file has "
                            f"{len(data)}; download it again with `specdeck pull`")
    return GgufTensors(path, architecture, infos, data)


def _read_table(path: Path) -> tuple[str, dict[str, TensorInfo]]:
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_pairs = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        meta: dict[str, object] = {}
        for _ in range(n_pairs):
            key = read_string(f)
            meta[key] = read_value(f, struct.unpack("<I", f.read(4))[0])
        raw = [_tensor_info(f) for _ in range(n_tensors)]
        alignment = int(meta.get("general.alignment") or DEFAULT_ALIGNMENT)
        start = -(-f.tell() // alignment) * alignment
    infos = {name: TensorInfo(name, kind, dims, start + offset, _nbytes(kind, dims))
             for name, kind, dims, offset in raw}
    return str(meta.get("general.architecture") or ""), infos


def _tensor_info(f: BinaryIO) -> tuple[str, int, tuple[int, ...], int]:
    name = read_string(f)
    (n_dims,) = struct.unpack("<I", f.read(4))
    dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
    kind, offset = struct.unpack("<IQ", f.read(12))
    return name, int(kind), tuple(int(d) for d in dims), int(offset)


def _nbytes(kind: int, dims: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    count = int(np.prod(dims, dtype=np.int64))
    if dims[0] % block:
        raise ValueError(f"rows of {dims[0]} values do not split into blocks of {block}")
    return count // block * size
