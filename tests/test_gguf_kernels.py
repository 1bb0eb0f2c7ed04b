"""The GGUF kernels compute with the file's own values: every type the catalogue's files use,
against the gguf package's dequantization, and each row gets its one-row bits in any block."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import dequantize, quants
from gguf.constants import GGML_QUANT_SIZES

torch = pytest.importorskip("torch")

from backends.gguf_tensors import TensorInfo  # noqa: E402
from backends.torch import ggml, kquant  # noqa: E402
from backends.torch.gguf_layers import GgufLinear, Part  # noqa: E402

LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
# (offset of the fp16 super-block scales in a block): random bytes elsewhere are valid codes
K_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
needs_kquant = pytest.mark.skipif(not kquant.is_available(),
                                  reason="kquant needs AVX-512 VNNI or AVX2, and a C compiler")
needs_ggml = pytest.mark.skipif(not ggml.is_available(),
                                reason=f"ggml is not here: {ggml.unavailable_reason()}")


def stored(kind: T, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """A rows x k tensor as the file stores it: legacy types quantized by the gguf package,
    K-quants random blocks with small fp16 scales."""
    rng = np.random.default_rng(seed)
    if kind in LEGACY:
        return quants.quantize(rng.standard_normal((rows, k)).astype(np.float32), kind)
    block, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    for offset in K_SCALES[kind]:
        scale = (rng.random(len(blocks)) * 0.02 + 0.001).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def layer(kind: T, rows: int, k: int, packed: bool) -> tuple[GgufLinear, torch.Tensor]:
    data = stored(kind, rows, k)
    info = TensorInfo("w", int(kind), (k, rows), 0, data.nbytes)
    tiles = kquant.pack(int(kind), data, rows, k) if packed else None
    weight = torch.from_numpy(dequantize(data, kind).reshape(rows, k).astype(np.float32))
    return GgufLinear([Part(data.reshape(-1), info, packed=tiles)]), weight


def check(kind: T, packed: bool) -> None:
    rows, k = 48, 512
    linear, weight = layer(kind, rows, k, packed)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(1))
    out = linear(x)
    error = (out - x @ weight.T).norm() / (x @ weight.T).norm()
    assert error < 0.02, f"{kind.name}: relative error {error:.4f} against the file's values"
    for n in (1, 2, 3, 5, 9, 16):
        assert torch.equal(linear(x[:n]), out[:n]), f"{kind.name}: rows differ in a block of {n}"
    assert torch.equal(linear(x[7:8]), out[7:8])


@needs_kquant
@pytest.mark.parametrize("kind", LEGACY + K_QUANTS, ids=lambda t: t.name)
def test_kquant_computes_the_files_values_and_each_row_alone(kind):
    check(kind, packed=True)


def saturating(kind: T, rows: int, k: int) -> np.ndarray:
    """Blocks whose every code is the type's largest (Q8_0: its most negative, -128), where an
    int8 dot product that widens too late overflows."""
    block, size = GGML_QUANT_SIZES[kind]
    blocks = np.full((rows * k // block, size), 0x80 if kind == T.Q8_0 else 0xFF, np.uint8)
    scale = np.array([0.01], np.float16).view(np.uint8)
    for offset in K_SCALES.get(kind, (0, 2) if kind in (T.Q4_1, T.Q5_1) else (0,)):
        blocks[:, offset:offset + 2] = scale  # d, and the legacy types' m
    return blocks.reshape(rows, -1)


@needs_kquant
@pytest.mark.parametrize("kind", LEGACY + K_QUANTS, ids=lambda t: t.name)
def test_kquant_keeps_the_largest_codes_times_the_largest_activations_exact(kind):
    rows, k = 16, 256
    data = saturating(kind, rows, k)
    info = TensorInfo("w", int(kind), (k, rows), 0, data.nbytes)
    tiles = kquant.pack(int(kind), data, rows, k)
    linear = GgufLinear([Part(data.reshape(-1), info, packed=tiles)])
    weight = torch.from_numpy(dequantize(data, kind).reshape(rows, k).astype(np.float32))
    x = torch.stack([torch.ones(k), -torch.ones(k)])  # every activation code +127, then -127
    expected = x @ weight.T
    assert torch.allclose(linear(x), expected, rtol=1e-5, atol=1e-4 * expected.abs().max())


@needs_ggml
@pytest.mark.parametrize("kind", LEGACY + K_QUANTS, ids=lambda t: t.name)
def test_ggml_computes_the_files_values_and_each_row_alone(kind):
    check(kind, packed=False)


@needs_kquant
def test_a_row_selection_of_a_packed_layer_gives_those_rows_outputs():
    linear, _ = layer(T.Q6_K, 48, 256, packed=True)
    x = torch.randn(3, 256)
    ids = torch.tensor([5, 17, 40, 47])
    assert torch.equal(linear.rows(ids)(x), linear(x)[:, ids])


@needs_kquant
def test_kquant_refuses_shapes_its_tiles_cannot_hold():
    assert not kquant.can_take(int(T.Q4_K), 48, 896)  # 896 is no multiple of 256
    assert kquant.can_take(int(T.Q5_0), 48, 896) and not kquant.can_take(int(T.Q5_0), 40, 896)
    assert not kquant.can_take(int(T.F16), 48, 256)


@needs_kquant
def test_a_fused_layer_in_one_call_gives_each_part_its_own_bits():
    kinds, k = (T.Q4_K, T.Q6_K, T.Q8_0), 512
    parts = []
    for index, kind in enumerate(kinds):
        data = stored(kind, 32 * (index + 1), k, seed=index)
        info = TensorInfo(f"w{index}", int(kind), (k, len(data)), 0, data.nbytes)
        bias = torch.randn(len(data)) if kind != T.Q6_K else None
        part = Part(data.reshape(-1), info, bias=bias,
                    packed=kquant.pack(int(kind), data, len(data), k))
        parts.append(part)
    fused = GgufLinear(parts)
    assert fused._tiled is not None
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(2))  # two calls: 16 + 4
    out = fused(x)
    column = 0
    for part in parts:
        own = torch.empty(20, part.out_features)
        for start in range(0, 20, kquant.MAX_ROWS):
            rows = x[start:start + kquant.MAX_ROWS].contiguous()
            kquant.matmul_at(part.ggml_type, part._packed_at, part.out_features, rows,
                             part.bias, own[start:start + kquant.MAX_ROWS], 0)
        assert torch.equal(out[:, column:column + part.out_features], own)
        column += part.out_features
