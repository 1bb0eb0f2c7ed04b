"""EAGLE heads as MLX modules: EAGLE-3 (`Eagle3Head`) and EAGLE-1/2 (`Eagle1Head`), built by
backends/heads/eagle_net.py on mlx.nn, and their loader (`load_eagle_head`), reading the same
folders as the torch backend.

Knows: mlx's side of the heads' kit (MLX's fused RMSNorm and attention, mlx-lm's RoPE variants
for the head's own rope_parameters: default, linear, llama3, yarn, ...), mx.load of
safetensors, the parts an mlx-lm target lends a head (`target_parts`). Must not know: the
networks' structure (eagle_net), drafting policy (backends/heads/eagle_drafter.py), head
folders (backends/heads/eagle_format.py), the target beyond the sizes it is checked against.

API: backends/heads/eagle_net.py's, batch 1. Per-row positions: mx.fast.rope takes one
offset per batch entry, so the rows move to the batch axis for the rotation, as
backends/mlx/tree.py rotates the target's tree rows (each row gets a chain row's bits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.rope_utils import initialize_rope

from app.core.types import SpecdeckError
from backends.heads.eagle_format import (
    VOCAB_MAPS,
    EagleSpec,
    check_tensor_names,
    check_vocab_map,
    checked_spec,
    head_tensors,
)
from backends.heads.eagle_net import eagle_modules


class Module(nn.Module):
    """mlx.nn's module, called through `forward` as torch's is (eagle_net writes forward)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class RMSNorm(nn.Module):
    """Llama RMSNorm (MLX's fused kernel normalises in fp32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((size,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


def head_rope(spec: EagleSpec) -> nn.Module:
    """The head's own rotary embedding (its rope_parameters, not the target's)."""
    rope_type = spec.rope.get("rope_type", "default")
    scaling = None if rope_type == "default" else dict(spec.rope)
    try:
        return initialize_rope(spec.head_dim, spec.rope["rope_theta"], False, scaling,
                               spec.max_position_embeddings)
    except (KeyError, ValueError) as error:
        raise SpecdeckError(f"{spec.name} asks for RoPE {rope_type!r}, which this mlx-lm does "
                            f"not run ({error}): upgrade mlx-lm or use --backend torch"
                            ) from error


class Rope(Module):
    """The head's own RoPE: (positions [1, T], dtype) -> the rotation MlxKit.rotate applies."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        self.inner = head_rope(spec)

    def forward(self, positions: mx.array, dtype: mx.Dtype) -> tuple[nn.Module, mx.array]:
        return self.inner, positions[0]


class MlxKit:
    """backends/heads/eagle_net.Kit on mlx.nn."""

    Module, linear, embedding, rms_norm = Module, nn.Linear, nn.Embedding, RMSNorm

    def modules(self, items: list[nn.Module]) -> list[nn.Module]:
        return items

    def activation(self, name: str, spec: EagleSpec) -> Callable[[mx.array], mx.array]:
        if name != "silu":
            raise SpecdeckError(f"{spec.name} uses {name!r}; the MLX head runs silu heads (all "
                                "published EAGLE heads): use --backend torch")
        return nn.silu

    def rope(self, spec: EagleSpec) -> Rope:
        return Rope(spec)

    def rotate(self, x: mx.array, rotation: tuple[nn.Module, mx.array]) -> mx.array:
        rope, offsets = rotation  # x [1, heads, rows, dim]: rows to the batch axis and back
        return rope(x.swapaxes(0, 2), offset=offsets).swapaxes(0, 2)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None
               ) -> mx.array:
        if mask is None and q.shape[2] > 1:
            mask = "causal"  # lines the new rows up with the last keys: the past stays visible
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(q.shape[-1]),
                                                    mask=mask)

    def concat(self, parts: Sequence[mx.array], axis: int) -> mx.array:
        return mx.concatenate(list(parts), axis=axis)

    def buffer(self, module: nn.Module, name: str, values: Any) -> None:
        # an instance attribute, not a dict entry: no parameter, never cast by set_dtype
        object.__setattr__(module, name, mx.array(values))


_MODULES = eagle_modules(MlxKit())
Eagle3Head = _MODULES.Eagle3Head
Eagle1Head = _MODULES.Eagle1Head


def load_eagle_head(path: str | Path, *, kind: str, target_name: str, hidden_size: int,
                    vocab_size: int, n_layers: int, dtype: mx.Dtype = mx.float32
                    ) -> tuple[Any, EagleSpec]:
    """A head folder in any published layout as (module, spec), refused when it is not `kind`
    ("eagle3" or "eagle") or was built for another target (both named)."""
    spec = checked_spec(path, kind=kind, target_name=target_name, hidden_size=hidden_size,
                        vocab_size=vocab_size, n_layers=n_layers)
    head = Eagle3Head(spec) if kind == "eagle3" else Eagle1Head(spec)
    try:
        weights = head_tensors(mx.load(spec.weights), spec)
    except (OSError, RuntimeError, ValueError) as error:
        raise SpecdeckError(f"cannot read {spec.weights}: {error}") from error
    maps = {name: weights.pop(name) for name in VOCAB_MAPS if name in weights}
    _load_exactly(head, weights, spec)
    if kind == "eagle3":
        for name, values in maps.items():
            MlxKit().buffer(head, name, values)
        ids = np.array(head.to_target(mx.arange(spec.draft_vocab_size)))
        check_vocab_map(spec, int(ids.min()), int(ids.max()), int(np.array(head.t2d).sum()))
    head.set_dtype(dtype)
    mx.eval(head.parameters())
    return head, spec


def _load_exactly(head: nn.Module, weights: dict[str, mx.array], spec: EagleSpec) -> None:
    """Every parameter from the file, every tensor of the file used, each of its shape."""
    own = dict(tree_flatten(head.parameters()))
    check_tensor_names(spec, set(own), set(weights))
    wrong = [f"{name} {tuple(value.shape)} != {tuple(own[name].shape)}"
             for name, value in weights.items() if value.shape != own[name].shape]
    if wrong:
        raise SpecdeckError(f"{spec.name}'s tensors do not match its config: {wrong[:3]}")
    head.load_weights(list(weights.items()))


def target_parts(net: Any, name: str) -> tuple[Any, Any, Any]:
    """(input embedding, final norm, output layer as a callable) of an mlx-lm model."""
    outer = net if _child(net, "model") is not None else _child(net, "language_model")
    inner = _child(outer, "model")
    embed, norm = _child(inner, "embed_tokens"), _child(inner, "norm")
    if embed is None or norm is None:
        raise SpecdeckError(f"{name}'s mlx-lm model keeps no model.embed_tokens / model.norm, "
                            "which an EAGLE head reads: use --backend torch")
    # a multimodal model (Qwen3.5's) lends its text model's `model` as a property, and keeps
    # the output layer on the text model; absent when tied to the embedding
    lm_head = _child(outer, "lm_head")
    if lm_head is None:
        lm_head = _child(_child(net, "language_model"), "lm_head")
    return embed, norm, lm_head if lm_head is not None else embed.as_linear


def _child(module: Any, name: str) -> Any:
    # mlx modules are dicts: an empty one is falsy, so test for None, never truthiness
    return None if module is None else getattr(module, name, None)
