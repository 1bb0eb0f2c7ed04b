"""Linear layers and embeddings over a GGUF file's own tensors.

Knows: byte views of memory-mapped tensors (backends/gguf_tensors.py), which kernel computes
a tensor (kquant.py's tiles where it takes the type, else ggml.py's dot products), the
gguf package's dequantization (embedding rows). Must not know: models' architectures,
sessions, drafting.

Each tensor is computed by one kernel, chosen at load from its type and shape only, and both
kernels give a row the same bits whatever the rows beside it: speculation stays lossless.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from gguf import dequantize
from gguf.constants import GGMLQuantizationType

from backends.gguf_tensors import GgufTensors, TensorInfo
from backends.torch import ggml, kquant

F32 = 0


class Part:
    """One stored weight tensor (or a row selection of it) inside a GgufLinear: computed on
    kquant's tiles repacked from it (`packed`), or on the file's blocks by ggml."""

    def __init__(self, data: np.ndarray, info: TensorInfo, order: np.ndarray | None = None,
                 bias: torch.Tensor | None = None, packed: np.ndarray | None = None) -> None:
        self.data, self.ggml_type, self.in_features = data, info.ggml_type, info.row_length
        self.order = None if order is None else np.ascontiguousarray(order, dtype=np.int32)
        self.out_features = info.rows if self.order is None else len(self.order)
        self.bias = None if bias is None else bias.float().contiguous()
        self.packed = packed  # kquant tiles, rows in HF order; data is then never read
        self.path: Path | None = None  # the file data maps, where it maps one
        self._info = info
        self.packed_rows = info.rows  # a row selection's tiles may hold more than it keeps
        self._packed_at = 0 if packed is None else packed.ctypes.data  # read once, not per step

    def rows(self, ids: np.ndarray) -> Part:
        """The part restricted to its output rows ids (a drafter's vocabulary subset)."""
        order = ids if self.order is None else self.order[ids]
        bias = None if self.bias is None else self.bias[torch.as_tensor(ids)]
        if self.packed is None:
            return Part(self.data, self._info, order, bias)  # ggml reads them in place
        # kquant's tiles hold 16 rows: the last row repeats up to a tile, its outputs dropped
        tiled = np.concatenate([order, np.repeat(order[-1:], -len(order) % kquant.TILE)])
        rows = np.ascontiguousarray(self.data.reshape(self._info.rows, -1)[tiled])
        info = TensorInfo(self._info.name, self.ggml_type, (self.in_features, len(tiled)), 0,
                          rows.nbytes)
        part = Part(rows.reshape(-1), info, None, bias,
                    kquant.pack(self.ggml_type, rows, len(tiled), self.in_features))
        part.out_features = len(order)
        return part

    def float_rows(self, start: int, stop: int) -> torch.Tensor | None:
        """Output rows start..stop of the part's weights as float32 (in its row order); None
        for a padded row selection."""
        if self.packed is not None and self.packed_rows != self.out_features:
            return None
        row_bytes = self._info.nbytes // self._info.rows
        if self.path is not None and self.order is None:
            # read, not mapped: the file's pages stay out of this process
            with self.path.open("rb") as f:
                raw = os.pread(f.fileno(), (stop - start) * row_bytes,
                               self._info.offset + start * row_bytes)
            rows = np.frombuffer(raw, np.uint8).reshape(stop - start, row_bytes)
        else:
            stored = self.data.reshape(self._info.rows, row_bytes)
            rows = stored[start:stop] if self.order is None else stored[self.order[start:stop]]
        values = dequantize(rows, GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def resident_bytes(self) -> int:
        return int(self.packed.nbytes if self.packed is not None else self.data.nbytes)

    def compute(self, x: torch.Tensor, out: torch.Tensor, column: int,
                quantized: dict[int, np.ndarray]) -> None:
        if self.packed is None:
            ggml.matmul(self.ggml_type, self.data, self.order, self.out_features, x, self.bias,
                        out, column, quantized)
        elif self.packed_rows == self.out_features:
            kquant.matmul_at(self.ggml_type, self._packed_at, self.out_features, x, self.bias,
                             out, column)
        else:
            full = torch.empty((x.shape[0], self.packed_rows), dtype=torch.float32)
            kquant.matmul_at(self.ggml_type, self._packed_at, self.packed_rows, x, None, full,
                             0)
            part = full[:, :self.out_features]
            out[:, column:column + self.out_features] = (part if self.bias is None
                                                          else part + self.bias)


class GgufLinear(torch.nn.Module):
    """x [..., in] float -> [..., out] float32: the parts' outputs side by side. input_order:
    for a stored matrix whose columns are in another order than the layer's inputs, the
    input each stored column reads (columns cross quantization blocks; inputs do not).
    output_order: for a layer whose rows interleave several stored tensors' rows, the
    output side by side each of its outputs is (a row cannot be read from two tensors)."""

    def __init__(self, parts: list[Part], input_order: np.ndarray | None = None,
                 output_order: np.ndarray | None = None) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("parts of one layer read inputs of one width")
        self.parts = parts  # plain attribute: the file's bytes are no module state
        self.input_order = (None if input_order is None
                            else torch.from_numpy(np.asarray(input_order, dtype=np.int64)))
        self.output_order = (None if output_order is None
                             else torch.from_numpy(np.asarray(output_order, dtype=np.int64)))
        self.in_features = parts[0].in_features
        self.out_features = (sum(p.out_features for p in parts) if output_order is None
                             else len(output_order))
        self.bias = None
        self._tiled = _tiled(parts)

    def rows(self, ids: torch.Tensor) -> GgufLinear:
        """The layer restricted to output rows ids (one-part layers only)."""
        if len(self.parts) != 1 or self.output_order is not None:
            raise ValueError("only a one-part layer can be restricted to rows")
        order = None if self.input_order is None else self.input_order.numpy()
        return GgufLinear([self.parts[0].rows(ids.cpu().numpy())], order)

    def stored_bytes(self) -> int:
        return sum(p.resident_bytes() for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if self.input_order is not None:
            flat = flat.index_select(1, self.input_order)
        flat = flat.contiguous()
        stored = sum(p.out_features for p in self.parts)
        out = torch.empty((flat.shape[0], stored), dtype=torch.float32)
        if flat.shape[0] and self._tiled is not None:
            kquant.matmul_parts(self._tiled, flat, out)
        elif flat.shape[0]:
            quantized: dict[int, np.ndarray] = {}  # x per activation type, shared by parts
            column = 0
            for part in self.parts:
                part.compute(flat, out, column, quantized)
                column += part.out_features
        if self.output_order is not None:
            out = out.index_select(1, self.output_order)
        return out.reshape(*x.shape[:-1], self.out_features)


def _tiled(parts: list[Part]) -> kquant.Parts | None:
    """The parts as one kquant call, where every part is on whole tiles of its own (one call
    quantizes the input once and splits all their tiles between the threads); else None."""
    if len(parts) > kquant.Parts.MAX or any(
            p.packed is None or p.packed_rows != p.out_features for p in parts):
        return None
    return kquant.Parts([(p.ggml_type, p._packed_at, p.out_features, p.bias) for p in parts])


class GgufEmbedding(torch.nn.Module):
    """Token ids -> float32 rows of a stored table, each row dequantized when looked up, and
    scaled where the module it replaces scaled them (`scale`: Gemma's sqrt(hidden))."""

    def __init__(self, tensors: GgufTensors, name: str, scale: float | None = None) -> None:
        super().__init__()
        self.info = tensors.infos[name]
        self.data = tensors.bytes_of(name)
        self.num_embeddings, self.embedding_dim = self.info.rows, self.info.row_length
        # a float32 tensor, as transformers' ScaledWordEmbedding multiplies by its buffer
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).numpy()
        table = self.data.reshape(self.num_embeddings, -1)
        values = dequantize(table[flat], GGMLQuantizationType(self.info.ggml_type))
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        out = out.reshape(*ids.shape, self.embedding_dim)
        return out if self.scale is None else out * self.scale

    def stored_bytes(self) -> int:
        return int(self.data.nbytes)
