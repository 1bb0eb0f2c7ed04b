"""Quantized MTP folders read as float: which quantization a folder's config and safetensors
headers declare, the tensors each quantized weight is stored as, and the weight they stand
for, computed on the array library the backend read them with.

Knows: the two forms published MTP layers come in, and their dequantization as the readers
of each compute it:
- block FP8 (`quantization_config` {"quant_method": "fp8", "weight_block_size": [bm, bn]},
  as Qwen3 / Qwen3.5 FP8 and DeepSeek checkpoints ship): `X` float8_e4m3fn beside
  `X_scale_inv`, one float32 scale per bm x bn block of the last two dimensions over a grid
  of ceil(rows / bm) x ceil(cols / bn) blocks (the edge blocks partial; no block size: one
  scale for the tensor); the weight is float32(X) * float32(its block's scale), in float32
  (transformers' integrations/finegrained_fp8.py: Fp8Dequantize._dequantize_one at load,
  _dequantize_fp8_weight at the edges; mlx-lm's deepseek_v3 sanitize pads to the grid alike);
- MLX affine (`quantization` {"group_size": g, "bits": b}, per-module overrides beside them,
  as mlx-lm and mlx-vlm conversions write it): `P.weight` uint32 words holding b-bit codes as
  one little-endian bit stream per row, `P.scales` and `P.biases` per g codes of the last
  dimension; the weight is scales * code + biases in the scales' dtype (mlx.core.dequantize).
The backend casts the result to the target's dtype as it does every MTP tensor: one rounding,
as the readers round to the model's dtype. Must not know: the MTP layer's layout or modules
(backends/heads/mtp_folder.py, mtp_format.py), which backend builds it; any other
quantization (GPTQ, AWQ, bitsandbytes, MLX's mxfp4 / nvfp4, ...), which is refused naming
what the folder declares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from app.core.types import SpecdeckError

T = TypeVar("T")
FP8_SCALE = "_scale_inv"  # X's block scales are X + this
FP8_ACTIVATION = (".activation_scale", ".input_scale")  # static activation scales: unused here
AFFINE = (".scales", ".biases")  # P.weight's per-group scales and biases are P + these
QUANTIZED_SUFFIXES = (FP8_SCALE, *AFFINE, ".weight_scale", *FP8_ACTIVATION)
FLOAT_SCALES = frozenset({"F32", "BF16", "F16"})
DEFAULT_BLOCK = (128, 128)


@dataclass(frozen=True)
class Stored:
    """A tensor as its safetensors header describes it."""

    shape: tuple[int, ...]
    dtype: str  # the header's name: "F8_E4M3", "U32", "BF16", ...


@dataclass(frozen=True)
class Fp8Blocks:
    """A float8_e4m3fn weight and its scales, one per block (None: one for the tensor)."""

    block: tuple[int, int] | None


@dataclass(frozen=True)
class Affine:
    """An MLX affine weight: bits-bit codes, a scale and a bias per group_size codes."""

    group_size: int
    bits: int


@dataclass(frozen=True)
class Quantization:
    """What a folder declares and, per quantized weight's name, how it is stored."""

    declared: str  # as a message names it: "block FP8 [128, 128]", "MLX affine 4-bit"
    weights: Mapping[str, Fp8Blocks | Affine] = field(default_factory=dict)
    unused: frozenset[str] = frozenset()  # stored tensors the weights do not need

    def shape(self, name: str, stored: Stored) -> tuple[int, ...]:
        """The shape of the weight `name` stands for (MLX packs codes into uint32 words)."""
        form = self.weights.get(name)
        if isinstance(form, Affine):
            return (*stored.shape[:-1], stored.shape[-1] * 32 // form.bits)
        return stored.shape


def read_quantization(folder: Path, config: Mapping[str, Any],
                      stored: Mapping[str, Stored]) -> Quantization | None:
    """The quantization the folder's config declares, checked against the headers of its
    MTP layer's tensors (`stored`); None for a float folder. SpecdeckError naming what is
    read for any other quantization, or tensors that are not what the config declares."""
    declared = _declared(config)
    if declared is None:
        named = _unread(stored, Quantization("no quantization", {}))
        if named:
            raise SpecdeckError(f"{folder} holds a quantized MTP layer ({named[0]}, ...) but "
                                "its config declares no quantization specdeck reads; use the "
                                "bf16 folder or the target's original checkpoint")
        return None
    method, settings = declared
    if method == "fp8":
        quantization = _fp8(folder, settings, stored)
    elif method == "mlx":
        quantization = _affine(folder, settings, stored)
    else:
        raise SpecdeckError(f"{folder} holds an MTP layer quantized as {method!r} (its "
                            "config's quantization_config): specdeck reads float, block FP8 "
                            "and MLX affine MTP folders; use the bf16 folder or the target's "
                            "original checkpoint")
    _refuse_leftovers(folder, quantization, stored)
    return quantization


def dequantized(stored: Mapping[str, T], quantization: Quantization | None) -> dict[str, T]:
    """The tensors as read, each quantized weight in its readers' float form and the tensors
    it was stored as dropped; float tensors as they are."""
    if quantization is None:
        return dict(stored)
    out = {k: v for k, v in stored.items() if k not in quantization.unused}
    for name, form in quantization.weights.items():
        if name in out:
            out[name] = _dequantize(name, form, stored)
    return out


def _declared(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """("fp8" | "mlx" | another method's name, its settings) from the config or its text
    config; mlx-lm writes its dict under both `quantization` and `quantization_config`."""
    for holder in (config, config.get("text_config") or {}):
        if holder.get("quantization"):
            return "mlx", holder["quantization"]
        settings = holder.get("quantization_config")
        if settings:
            method = settings.get("quant_method")
            if method is None and {"group_size", "bits"} <= set(settings):
                return "mlx", settings
            return str(method), settings
    return None


def _fp8(folder: Path, settings: Mapping[str, Any], stored: Mapping[str, Stored]
         ) -> Quantization:
    # transformers' FineGrainedFP8Config: 128 x 128 where the config names none, one scale
    # per tensor where it names null
    block = settings.get("weight_block_size", DEFAULT_BLOCK)
    block = (int(block[0]), int(block[1])) if block else None
    weights: dict[str, Fp8Blocks | Affine] = {}
    for scale in (k for k in stored if k.endswith(FP8_SCALE)):
        name = scale.removesuffix(FP8_SCALE)
        weight = stored.get(name)
        if weight is None or weight.dtype != "F8_E4M3" or stored[scale].dtype not in FLOAT_SCALES:
            raise SpecdeckError(f"{folder}: {scale} ({stored[scale].dtype}) scales "
                                f"{name} ({weight.dtype if weight else 'absent'}); specdeck "
                                "reads float8_e4m3fn weights with float scales")
        grid = _grid(weight.shape, block)
        fits = stored[scale].shape == grid if block else math.prod(stored[scale].shape) == 1
        if not fits:
            raise SpecdeckError(f"{folder}: {scale} is of shape {list(stored[scale].shape)}, "
                                f"not the {list(grid)} blocks of {block} over {name} "
                                f"{list(weight.shape)}")
        weights[name] = Fp8Blocks(block)
    unused = {k for k in stored if k.endswith((FP8_SCALE, *FP8_ACTIVATION))}
    return Quantization(f"block FP8 {list(block) if block else 'per tensor'}", weights,
                        frozenset(unused))


def _grid(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scales' shape over a weight: its leading dimensions, then the blocks' grid."""
    if block is None:
        return ()
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def _affine(folder: Path, settings: Mapping[str, Any], stored: Mapping[str, Stored]
            ) -> Quantization:
    mode = settings.get("mode", "affine")
    if mode != "affine":
        raise SpecdeckError(f"{folder} holds an MTP layer in MLX's {mode} quantization: "
                            "specdeck reads MLX affine MTP folders only")
    weights: dict[str, Fp8Blocks | Affine] = {}
    for scales in (k for k in stored if k.endswith(".scales")):
        module = scales.removesuffix(".scales")
        form = _module_form(settings, module)
        weights[f"{module}.weight"] = form
        _check_affine(folder, module, form, stored)
    unused = {k for k in stored if k.endswith(AFFINE)}
    return Quantization(f"MLX affine {settings.get('bits')}-bit", weights, frozenset(unused))


def _module_form(settings: Mapping[str, Any], module: str) -> Affine:
    """The module's own entry where the config names it (mlx-lm's mixed recipes key them by
    module path, which may carry a prefix the folder's names dropped), else the default."""
    own = next((v for k, v in settings.items() if isinstance(v, Mapping)
                and (k == module or k.endswith(f".{module}"))), settings)
    return Affine(int(own.get("group_size", 64)), int(own.get("bits", 4)))


def _check_affine(folder: Path, module: str, form: Affine, stored: Mapping[str, Stored]
                  ) -> None:
    weight, scales = stored.get(f"{module}.weight"), stored[f"{module}.scales"]
    biases = stored.get(f"{module}.biases")
    fits = (weight is not None and weight.dtype == "U32" and biases is not None
            and biases.shape == scales.shape and scales.dtype in FLOAT_SCALES
            and 2 <= form.bits <= 8
            and weight.shape[-1] * 32 == scales.shape[-1] * form.group_size * form.bits)
    if not fits:
        found = ", ".join(f"{k} {list(s.shape)} {s.dtype}" for k, s in stored.items()
                          if k.startswith(f"{module}."))
        raise SpecdeckError(f"{folder}: {module} is not MLX affine at {form.bits} bits in "
                            f"groups of {form.group_size} as its config says ({found})")


def _refuse_leftovers(folder: Path, quantization: Quantization,
                      stored: Mapping[str, Stored]) -> None:
    left = _unread(stored, quantization)
    if left:
        raise SpecdeckError(f"{folder} declares {quantization.declared} but also holds "
                            f"{left[0]} ({stored[left[0]].dtype}), which it does not read")


def _unread(stored: Mapping[str, Stored], quantization: Quantization) -> list[str]:
    """Quantized tensors the declared form does not read (another form's names, float8 or
    packed weights without their scales): refused, never loaded as if float."""
    return sorted(k for k, s in stored.items() if k not in quantization.unused
                  and k not in quantization.weights
                  and (k.endswith(QUANTIZED_SUFFIXES) or s.dtype.startswith(("F8", "U", "I"))))


def _dequantize(name: str, form: Fp8Blocks | Affine, stored: Mapping[str, Any]) -> Any:
    weight = stored[name]
    torch = type(weight).__module__.split(".")[0] == "torch"  # else mlx.core's array
    if isinstance(form, Fp8Blocks):
        scale = stored[f"{name}{FP8_SCALE}"]
        return (_fp8_torch if torch else _fp8_mlx)(weight, scale, form.block)
    module = name.removesuffix(".weight")
    scales, biases = stored[f"{module}.scales"], stored[f"{module}.biases"]
    return (_affine_torch if torch else _affine_mlx)(weight, scales, biases, form)


def _fp8_torch(weight: Any, scale: Any, block: tuple[int, int] | None) -> Any:
    import torch

    values, scale = weight.to(torch.float32), scale.to(torch.float32)
    if block is None:
        return values * scale.reshape(())
    rows, cols = values.shape[-2:]
    # each element takes its block's scale: the grid repeated out, cut at the edges
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return values * scale.repeat_interleave(block[1], dim=-1)[..., :cols]


def _fp8_mlx(weight: Any, scale: Any, block: tuple[int, int] | None) -> Any:
    import mlx.core as mx

    # mx.load hands float8_e4m3fn tensors over as their bytes
    values = mx.from_fp8(weight, dtype=mx.float32) if weight.dtype == mx.uint8 else \
        weight.astype(mx.float32)
    scale = scale.astype(mx.float32)
    if block is None:
        return values * scale.reshape(())
    rows, cols = values.shape[-2:]
    scale = mx.repeat(scale, block[0], axis=-2)[..., :rows, :]
    return values * mx.repeat(scale, block[1], axis=-1)[..., :cols]


def _affine_torch(weight: Any, scales: Any, biases: Any, form: Affine) -> Any:
    import torch

    words = weight.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = torch.cat([words, torch.zeros_like(words[..., :1])], dim=-1)
    # code j's bits start at bit j * bits of the row's stream and may run into the next word
    starts = torch.arange(scales.shape[-1] * form.group_size) * form.bits
    pairs = words[..., starts // 32] | (words[..., starts // 32 + 1] << 32)
    codes = (pairs >> (starts % 32)) & ((1 << form.bits) - 1)
    codes = codes.to(scales.dtype).unflatten(-1, (-1, form.group_size))
    return (codes * scales[..., None] + biases[..., None]).flatten(-2)


def _affine_mlx(weight: Any, scales: Any, biases: Any, form: Affine) -> Any:
    import mlx.core as mx

    return mx.dequantize(weight, scales, biases, group_size=form.group_size, bits=form.bits)
