"""Quantized linear layers for CPU targets and drafters: int8 weights, kept row-invariant.

Knows: torch's int8 CPU kernels (`_weight_int8pack_mm`, oneDNN's prepacked qlinear), per-channel
weight scales, per-token activation scales. Must not know: models, sessions, drafting rules.

Both layers give a row the same bits whatever other rows share its forward, so a verify forward
over k+1 tokens reproduces one-token decoding exactly:
- `Int8Linear` (dtype int8): weight-only; bf16 activations through `_weight_int8pack_mm`.
- `W8A8Linear` (dtype w8a8): activations quantized per token (each row its own scale), then an
  exact int32 dot product in oneDNN over weights packed once at load. One row read the weights
  in 69 ms and 8 rows in 74 ms over the 1.5B Qwen's layers here; the weight-only kernel works in
  blocks of 4 rows and took 91 and 286 ms.
- `Int4Linear` (dtype int4): 4-bit weights in groups of 32 inputs, each group its own scale and
  minimum (Q4_K's sub-block layout), bf16 activations through `_weight_int4pack_mm_for_cpu`,
  which dequantizes a weight block once and runs every row through it alike. Prompts run on it
  too, in the target's exact blocks: an 8-bit prompt copy gave a prompt's rows other bits
  than the same rows decoded, so an answer depended on what the cache held (and cost a byte
  a weight more). The load-time
  check (exactness.py) confirms the row invariance on the model's own layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from backends.cpu import cpu_has_native_bf16

_ZERO_POINT = 128  # activations go to oneDNN as uint8: value + 128


class Int8Linear(torch.nn.Module):
    """Weight-only int8 linear layer (per-channel scales, bf16 activations).

    From FLOAT_ROWS rows on (a drafter's prompt: a target runs every forward in blocks of at
    most 16 rows) a CPU without native bf16 multiplies in float32 with the weights converted
    for the call: torch's int8 kernel
    runs its bf16 there at about half the float32 rate (a 1536x8960 layer, 700 rows: 459 ms
    against 314 ms with the conversion, 2-core Zen 3); below 256 rows the conversion costs
    more than it saves.
    """

    FLOAT_ROWS = 256

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)  # [out, in], int8
        self.register_buffer("scales", scales)  # [out], bf16
        self.register_buffer("bias", bias)

    @classmethod
    def quantize(cls, linear: torch.nn.Linear) -> Int8Linear:
        weight_int8, scales = quantize_weight(linear.weight)
        return cls(weight_int8, scales.to(torch.bfloat16), bf16_bias(linear))

    def rows(self, ids: torch.Tensor) -> Int8Linear:
        """The layer restricted to the output rows ids."""
        bias = None if self.bias is None else self.bias[ids].contiguous()
        return Int8Linear(self.weight_int8[ids].contiguous(), self.scales[ids].contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if len(flat) >= self.FLOAT_ROWS and flat.device.type == "cpu" and _float_is_faster():
            out = ((flat.float() @ self.weight_int8.float().t()) * self.scales.float()
                   ).to(torch.bfloat16)
        else:
            out = torch._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class W8A8Linear(torch.nn.Module):
    """int8 weights and per-token int8 activations; an exact int32 matmul in oneDNN.

    Each row's scale comes from that row alone and the integer dot product is exact, so rows
    never influence each other. The packed weight is oneDNN's opaque layout: `rows` needs the
    plain int8 weight, which only layers built with keep_int8 hold (the output layer, for a
    drafter restricted to part of the vocabulary).
    """

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None, keep_int8: bool = False,
                 out_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.out_dtype = out_dtype
        self.packed = torch.ops.onednn.qlinear_prepack(weight_int8, None)
        self.weight_int8 = weight_int8 if keep_int8 else None
        # plain attributes, not buffers: the cast to bf16 must leave them as oneDNN takes them
        self.scales = scales.float()  # [out]
        self.zero_points = torch.zeros(len(scales), dtype=torch.int32)
        self.register_buffer("bias", bias)

    @classmethod
    def quantize(cls, linear: torch.nn.Linear, keep_int8: bool = False,
                 out_dtype: torch.dtype = torch.bfloat16) -> W8A8Linear:
        weight_int8, scales = quantize_weight(linear.weight)
        return cls(weight_int8, scales, bf16_bias(linear), keep_int8, out_dtype)

    def rows(self, ids: torch.Tensor) -> W8A8Linear:
        """The layer restricted to the output rows ids."""
        if self.weight_int8 is None:
            raise ValueError("this w8a8 layer kept only its packed weight; it cannot be sliced")
        bias = None if self.bias is None else self.bias[ids].contiguous()
        return W8A8Linear(self.weight_int8[ids].contiguous(), self.scales[ids].contiguous(), bias,
                          keep_int8=True, out_dtype=self.out_dtype)

    def packed_bytes(self) -> int:
        return self.out_features * self.in_features

    def matmul(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 [rows, out]: the exact int32 products of uint8 codes, times the weight scales."""
        return torch.ops.onednn.qlinear_pointwise(
            codes, 1.0, _ZERO_POINT, self.packed, self.scales, self.zero_points, None, 1.0, 0,
            torch.float32, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes, row_scales = _quantized_input(x)
        out = (self.matmul(codes) * row_scales).to(self.out_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(torch.nn.Module):
    """4-bit weights (asymmetric, per group of GROUP inputs) with bf16 activations.

    torch's int4 kernel reads the weights once per 4 rows, so prompts are slow on it (a
    150-token prompt cost 38 passes); w4a8 is the fast 4-bit mode where VNNI is.
    """

    GROUP = 32

    def __init__(self, codes: torch.Tensor, scales_zeros: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        # plain attributes: the opaque packed layout and its bf16 [in/GROUP, out, 2] table
        # must not be cast when the model moves to bf16
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.scales_zeros = scales_zeros
        self.register_buffer("bias", bias)

    @classmethod
    def can_take(cls, linear: torch.nn.Module) -> bool:
        return isinstance(linear, torch.nn.Linear) and linear.in_features % cls.GROUP == 0

    @classmethod
    def quantize(cls, linear: torch.nn.Linear) -> Int4Linear:
        codes, scales_zeros = quantize_weight_int4(linear.weight, cls.GROUP)
        return cls(codes, scales_zeros, bf16_bias(linear))

    def packed_bytes(self) -> int:
        return self.out_features * self.in_features // 2 + self.scales_zeros.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.GROUP,
                                                         self.scales_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


@functools.cache
def _float_is_faster() -> bool:
    return not cpu_has_native_bf16()


def quantize_weight_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes 0..15 (int32 [out, in]) and bf16 [in/group, out, 2] (scale, zero) with
    w = (code - 8) * scale + zero: each group spans its own minimum to maximum."""
    out_features, in_features = weight.shape
    grouped = weight.detach().float().reshape(out_features, in_features // group, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp(min=1e-8).to(torch.bfloat16).float()
    # the minimum moves to the grid of the rounded scale, so code 0 is the group's minimum
    codes = torch.round((grouped - low[..., None]) / scales[..., None]).clamp_(0, 15)
    zeros = low + 8.0 * scales
    table = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
    return codes.to(torch.int32).reshape(out_features, in_features), table


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (int8 [out, in], fp32 scales [out])."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def bf16_bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 codes, offset to uint8, and each row's fp32 scale [rows, 1]."""
    amax = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-8)
    codes = (x * (127.0 / amax)).round_().add_(_ZERO_POINT)  # within [1, 255] by construction
    return codes.to(torch.uint8), amax / 127.0


# q/k/v (and gate/up) projections read the same tensor one after another: quantize it once.
# Holding the tensor keeps its identity from being reused. (Inference tensors keep no version
# counter; the models here never change a projection's input in place between projections.)
_last_input: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _quantized_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    global _last_input
    last = _last_input
    if last is not None and last[0] is x:
        return last[1], last[2]
    codes, scales = quantize_rows(x.reshape(-1, x.shape[-1]).float())
    _last_input = (x, codes, scales)
    return codes, scales


def int4_is_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@functools.cache
def int4_is_exact(max_rows: int = 16) -> bool:
    """Whether this CPU's int4 matmul gives each of up to max_rows rows the bits it gets alone."""
    return int4_is_available() and rows_are_invariant(
        lambda linear: Int4Linear.quantize(linear), max_rows)


def rows_are_invariant(quantize: Callable[[torch.nn.Linear], torch.nn.Module],
                       max_rows: int) -> bool:
    """Whether layers made by quantize give each of up to max_rows rows the bits it gets alone
    (random layers of the 1.5B Qwen's widths; the model's own layers are checked at load)."""
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in ((64, 1536), (32, 8960)):
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        with torch.no_grad():
            linear.weight.normal_(0, 0.02, generator=generator)
        layer = quantize(linear)
        x = torch.randn((max_rows, in_features), generator=generator).to(torch.bfloat16)
        with torch.inference_mode():
            alone = torch.cat([layer(x[i:i + 1]) for i in range(max_rows)])
            if not all(torch.equal(layer(x[:n]), alone[:n]) for n in range(2, max_rows + 1)):
                return False
    return True


@functools.cache
def w8a8_is_exact() -> bool:
    """Whether oneDNN's int8 matmul is exact and row-invariant on this CPU.

    CPUs without VNNI multiply uint8 by int8 in pairs summed into int16, which saturates; there
    a row's result could depend on the kernel its row count picks. Full-range random codes hit
    that saturation, so this check catches it.
    """
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in ((64, 512), (300, 1536)):
        weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8,
                               generator=generator)
        x = torch.randint(-127, 128, (9, in_features), generator=generator).float()
        layer = W8A8Linear(weight, torch.ones(out_features), None)
        codes = (x + _ZERO_POINT).to(torch.uint8)
        exact = (x.double() @ weight.double().t())
        for n in (1, 2, 4, 9):
            if not torch.equal(layer.matmul(codes[:n]).double(), exact[:n].float().double()):
                return False
    return True
