"""EAGLE heads as MLX modules: EAGLE-3 (`Eagle3Head`) and EAGLE-1/2 (`Eagle1Head`), and their
loader (`load_eagle_head`), reading the same folders as the torch backend.

Knows: one draft step of each head (../shared/docs/HEADS.md 1.2, 2.1; the math of
backends/torch/heads/eagle.py, which is held to the authors' code), mlx.nn, mx.load of
safetensors, mlx-lm's RoPE variants (the head's own rope_parameters: default, linear, llama3,
yarn, ...). Must not know: the engine, drafting policy (backends/heads/eagle_drafter.py),
the target beyond the sizes it is checked against and the parts it lends (embedding, output
layer). Folder parsing, kind and target checks, stored names: eagle_format, shared.

API, as torch's: `head.project(states)` (fc over captured states, ascending layer order) ->
[..., H]; `head(embeds, hidden, positions, past=None, mask=None)` -> (h, present) for rows
at positions [1, T] (each its own: an EAGLE-2 tree's rows share a depth's position), mask
bool [T, past + T] (True = may attend; None = causal over the new rows after the past);
`head.logits(h)`; `head.feedback(h)`; `head.to_target(draft_ids)`; `head.own_embedding()`.

Per-row positions: mx.fast.rope takes one offset per batch entry, so the rows move to the
batch axis for the rotation, as backends/mlx/tree.py rotates the target's tree rows.
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
    EagleSpec,
    check_vocab_map,
    checked_spec,
    module_name,
)

KV = tuple[mx.array, mx.array]  # [B, kv_heads, keys, head_dim] each, keys after RoPE


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


class HeadAttention(nn.Module):
    """Attention over the head's KV cache; in_features is 2H for EAGLE-3's layer."""

    def __init__(self, spec: EagleSpec, in_features: int) -> None:
        super().__init__()
        qkv_bias = spec.attention_bias or spec.qkv_bias
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, spec.hidden_size,
                                bias=spec.attention_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
        self.rope = head_rope(spec)

    def __call__(self, x: mx.array, positions: mx.array, past: KV | None,
                 mask: mx.array | None) -> tuple[mx.array, KV]:
        batch, rows, _ = x.shape
        q = self.q_proj(x).reshape(batch, rows, self.heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, rows, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, rows, self.kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        q, k = self._rotate(q, positions), self._rotate(k, positions)
        if past is not None:
            k, v = mx.concatenate((past[0], k), axis=2), mx.concatenate((past[1], v), axis=2)
        if mask is None and rows > 1:
            mask = "causal"  # lines the new rows up with the last keys: the past stays visible
        out = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=1.0 / math.sqrt(self.head_dim), mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(batch, rows, -1)
        return self.o_proj(out), (k, v)

    def _rotate(self, x: mx.array, positions: mx.array) -> mx.array:
        """x [1, heads, rows, dim] rotated to positions [1, rows]: rows to the batch axis."""
        return self.rope(x.swapaxes(0, 2), offset=positions[0]).swapaxes(0, 2)


class HeadMLP(nn.Module):
    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        if spec.hidden_act != "silu":
            raise SpecdeckError(f"{spec.name} uses {spec.hidden_act!r}; the MLX head runs silu "
                                "heads (all published EAGLE heads): use --backend torch")
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads cat(input_layernorm(embed), hidden_norm(g))."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        self.norm_before_residual = spec.norm_before_residual
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = HeadAttention(spec, 2 * spec.hidden_size)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = HeadMLP(spec)

    def __call__(self, embeds: mx.array, hidden: mx.array, positions: mx.array,
                 past: KV | None, mask: mx.array | None) -> tuple[mx.array, KV]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = mx.concatenate((self.input_layernorm(embeds), normed), axis=-1)
        attn, present = self.self_attn(x, positions, past, mask)
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h)), present


class Eagle3Head(nn.Module):
    """One EAGLE-3 head; parameter names are the authors' (`midlayer.*`)."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        self.spec = spec
        width = spec.n_features * spec.target_hidden_size
        if spec.norm_before_fc:
            self.input_norm = RMSNorm(width, spec.rms_norm_eps)
        if spec.fc_norm:
            self.fc_norm = [RMSNorm(spec.target_hidden_size, spec.rms_norm_eps)
                            for _ in range(spec.n_features)]
        self.fc = nn.Linear(width, spec.hidden_size, bias=spec.fc_bias)
        self.midlayer = Eagle3Layer(spec)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
        if spec.own_embed:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        # draft id -> target id offsets; "_" keeps it out of the parameters (and set_dtype)
        self._d2t = mx.zeros((spec.draft_vocab_size,), dtype=mx.int32)

    def project(self, states: Sequence[mx.array]) -> mx.array:
        """fc over the target's captured states, ascending layer order."""
        if "fc_norm" in self:
            states = [norm(s) for norm, s in zip(self.fc_norm, states)]
        x = mx.concatenate(list(states), axis=-1)
        if "input_norm" in self:
            x = self.input_norm(x)
        return self.fc(x)

    def __call__(self, embeds: mx.array, hidden: mx.array, positions: mx.array,
                 past: Sequence[KV] | None = None, mask: mx.array | None = None
                 ) -> tuple[mx.array, list[KV]]:
        h, present = self.midlayer(embeds, hidden, positions, past[0] if past else None, mask)
        return h, [present]

    def logits(self, h: mx.array) -> mx.array:
        return self.lm_head(self.norm(h))

    def feedback(self, h: mx.array) -> mx.array:
        """The hidden state step j+1 reads: pre-norm, or post-norm for EAGLE 3.1 heads."""
        return self.norm(h) if self.spec.norm_output else h

    def to_target(self, draft_ids: mx.array) -> mx.array:
        return draft_ids + self._d2t[draft_ids]

    def own_embedding(self) -> nn.Module | None:
        return self.embed_tokens if "embed_tokens" in self else None

    def set_vocab_map(self, d2t: mx.array) -> None:
        self._d2t = d2t.astype(mx.int32)


class Eagle1Layer(nn.Module):
    """A Llama decoder layer; EAGLE-1's layer 0 has no input norm (fc output goes straight in)."""

    def __init__(self, spec: EagleSpec, index: int) -> None:
        super().__init__()
        if index:
            self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = HeadAttention(spec, spec.hidden_size)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = HeadMLP(spec)

    def __call__(self, x: mx.array, positions: mx.array, past: KV | None,
                 mask: mx.array | None) -> tuple[mx.array, KV]:
        normed = self.input_layernorm(x) if "input_layernorm" in self else x
        attn, present = self.self_attn(normed, positions, past, mask)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), present


class Eagle1Head(nn.Module):
    """An EAGLE-1/2 head: fc(cat(embed, feature)) -> decoder layer(s); logits come from the
    target's own output layer (`use_target_head`)."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        self.spec = spec
        self.fc = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=spec.fc_bias)
        self.layers = [Eagle1Layer(spec, i) for i in range(spec.n_layers)]
        if spec.own_embed:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self._target_head: Callable[[mx.array], mx.array] | None = None

    def use_target_head(self, head: Callable[[mx.array], mx.array]) -> None:
        """Read logits through the target's output layer (a callable, not adopted: the head's
        parameters stay its own)."""
        self._target_head = head

    def project(self, states: Sequence[mx.array]) -> mx.array:
        """The target's final post-norm state is the feature as it is."""
        return states[-1]

    def __call__(self, embeds: mx.array, hidden: mx.array, positions: mx.array,
                 past: Sequence[KV] | None = None, mask: mx.array | None = None
                 ) -> tuple[mx.array, list[KV]]:
        x = self.fc(mx.concatenate((embeds, hidden), axis=-1))
        present = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, past[i] if past else None, mask)
            present.append(kv)
        return x, present

    def logits(self, h: mx.array) -> mx.array:
        return self._target_head(h)

    def feedback(self, h: mx.array) -> mx.array:
        return h

    def to_target(self, draft_ids: mx.array) -> mx.array:
        return draft_ids

    def own_embedding(self) -> nn.Module | None:
        return self.embed_tokens if "embed_tokens" in self else None


def load_eagle_head(path: str | Path, *, kind: str, target_name: str, hidden_size: int,
                    vocab_size: int, n_layers: int, dtype: mx.Dtype = mx.float32
                    ) -> tuple[Eagle3Head | Eagle1Head, EagleSpec]:
    """A head folder in any published layout as (module, spec), refused when it is not `kind`
    ("eagle3" or "eagle") or was built for another target (both named)."""
    spec = checked_spec(path, kind=kind, target_name=target_name, hidden_size=hidden_size,
                        vocab_size=vocab_size, n_layers=n_layers)
    head = Eagle3Head(spec) if kind == "eagle3" else Eagle1Head(spec)
    try:
        stored = mx.load(spec.weights)
    except (OSError, RuntimeError, ValueError) as error:
        raise SpecdeckError(f"cannot read {spec.weights}: {error}") from error
    weights = {renamed: value for name, value in stored.items()
               if (renamed := module_name(name, spec)) is not None}
    maps = {name: weights.pop(name) for name in ("d2t", "t2d") if name in weights}
    _load_exactly(head, weights, spec)
    if kind == "eagle3":
        _set_vocab_map(head, maps, spec)
    head.set_dtype(dtype)
    mx.eval(head.parameters())
    return head, spec


def _load_exactly(head: nn.Module, weights: dict[str, mx.array], spec: EagleSpec) -> None:
    """Every parameter from the file, every tensor of the file used, each of its shape."""
    own = dict(tree_flatten(head.parameters()))
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or unexpected:
        raise SpecdeckError(f"{spec.name}'s tensors do not match its config: missing "
                            f"{missing[:6]}, unexpected {unexpected[:6]}")
    wrong = [f"{name} {tuple(value.shape)} != {tuple(own[name].shape)}"
             for name, value in weights.items() if value.shape != own[name].shape]
    if wrong:
        raise SpecdeckError(f"{spec.name}'s tensors do not match its config: {wrong[:3]}")
    head.load_weights(list(weights.items()))


def _set_vocab_map(head: Eagle3Head, maps: dict[str, mx.array], spec: EagleSpec) -> None:
    """d2t as stored (absent: identity, as the authors leave it out for a full vocabulary)."""
    if "d2t" in maps:
        head.set_vocab_map(maps["d2t"])
    ids = np.array(head.to_target(mx.arange(spec.draft_vocab_size)))
    marked = int(np.array(maps["t2d"]).astype(bool).sum()) if "t2d" in maps else 0
    check_vocab_map(spec, int(ids.min()), int(ids.max()), marked)


def target_parts(net: Any, name: str) -> tuple[Any, Any, Any]:
    """(input embedding, final norm, output layer as a callable) of an mlx-lm model."""
    outer = net if _child(net, "model") is not None else _child(net, "language_model")
    inner = _child(outer, "model")
    embed, norm = _child(inner, "embed_tokens"), _child(inner, "norm")
    if embed is None or norm is None:
        raise SpecdeckError(f"{name}'s mlx-lm model keeps no model.embed_tokens / model.norm, "
                            "which an EAGLE head reads: use --backend torch")
    lm_head = _child(outer, "lm_head")  # absent when tied to the embedding
    return embed, norm, lm_head if lm_head is not None else embed.as_linear


def _child(module: Any, name: str) -> Any:
    # mlx modules are dicts: an empty one is falsy, so test for None, never truthiness
    return None if module is None else getattr(module, name, None)
