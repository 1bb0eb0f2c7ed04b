"""The EAGLE heads' networks, written once over a layer kit: EAGLE-3 (`Eagle3Head`) and
EAGLE-1/2 (`Eagle1Head`), as `eagle_modules(kit)` builds them for one array library.

Knows: one draft step of each head exactly as ../shared/docs/HEADS.md 1.2 and 2.1 give it
(embedding first, then the hidden state; RMSNorm and softmax in fp32; the head's own RoPE),
the authors' parameter names (`midlayer.*`, `layers.N.*`, `fc`, `norm`, `lm_head`,
`embed_tokens`, the `d2t`/`t2d` vocabulary maps), the head API the drafter reads
(backends/heads/eagle_drafter.py). Must not know: an array library (the kit brings its
modules, kernels and RoPE: backends/torch/head_weights/eagle.py,
backends/mlx/head_weights/eagle.py), the engine, drafting policy, head folders
(backends/heads/eagle_format.py).

Head API: `head.project(states)` = fc over the captured target states (ascending layer order)
-> [..., H]; `head(embeds, hidden, positions, past=None, mask=None)` -> (h, present): h the
pre-norm output [B, T, H], present each layer's (k, v) [B, kv_heads, keys, head_dim] after
this call (past concatenated); positions [B, T] (each row its own: a tree's rows share a
depth's); mask bool [T, past + T], True = may attend (None: causal over the new rows, every
past key visible); `head.logits(h)` -> draft-vocabulary logits; `head.feedback(h)` -> what
step j + 1 reads as hidden; `head.to_target(ids)` maps draft ids to target ids;
`head.own_embedding()` -> its embedding or None (the target's serves).

Arrays are used through what torch tensors and mlx arrays spell alike (`reshape`,
`swapaxes`, indexing, `+`); the rest goes through the kit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from backends.heads.eagle_format import EagleSpec


class Kit(Protocol):
    """One array library's layers for the heads."""

    Module: type  # the library's module base; calling a module runs its `forward`
    linear: Callable[[int, int, bool], Any]  # (in, out, bias)
    embedding: Callable[[int, int], Any]  # (count, size)
    rms_norm: Callable[[int, float], Any]  # (size, eps): fp32 inside, as Llama's

    def modules(self, items: list[Any]) -> Any:
        """A list of modules whose parameters are the owner's, named by index."""

    def activation(self, name: str, spec: EagleSpec) -> Callable[[Any], Any]: ...

    def rope(self, spec: EagleSpec) -> Any:
        """The head's own rotary embedding: module(positions [B, T], dtype) -> a rotation
        that `rotate` applies to [B, heads, T, head_dim]."""

    def rotate(self, x: Any, rotation: Any) -> Any: ...

    def attend(self, q: Any, k: Any, v: Any, mask: Any | None) -> Any:
        """Scaled dot-product attention of q [B, heads, T, D] over k, v [B, kv_heads, keys,
        D] (grouped), under mask (module docstring); -> [B, heads, T, D]."""

    def concat(self, parts: Sequence[Any], axis: int) -> Any: ...

    def buffer(self, module: Any, name: str, values: np.ndarray) -> None:
        """An array the module keeps beside its parameters (never trained or cast)."""


@dataclass(frozen=True)
class EagleModules:
    """The head classes of one kit."""

    Eagle3Head: type
    Eagle1Head: type


def eagle_modules(kit: Kit) -> EagleModules:  # noqa: C901 - one class per network part
    """The EAGLE head classes on this kit's modules."""

    class HeadAttention(kit.Module):
        """Attention over the head's KV cache; in_features is 2H for EAGLE-3's layer."""

        def __init__(self, spec: EagleSpec, in_features: int) -> None:
            super().__init__()
            qkv_bias = spec.attention_bias or spec.qkv_bias
            self.heads, self.kv_heads = spec.num_heads, spec.num_kv_heads
            self.head_dim = spec.head_dim
            self.q_proj = kit.linear(in_features, self.heads * self.head_dim, qkv_bias)
            self.k_proj = kit.linear(in_features, self.kv_heads * self.head_dim, qkv_bias)
            self.v_proj = kit.linear(in_features, self.kv_heads * self.head_dim, qkv_bias)
            self.o_proj = kit.linear(self.heads * self.head_dim, spec.hidden_size,
                                     spec.attention_bias)
            if spec.qk_norm:
                self.q_norm = kit.rms_norm(self.head_dim, spec.rms_norm_eps)
                self.k_norm = kit.rms_norm(self.head_dim, spec.rms_norm_eps)

        def forward(self, x: Any, rotation: Any, past: Any, mask: Any) -> tuple[Any, Any]:
            batch, rows, _ = x.shape
            q = self.q_proj(x).reshape(batch, rows, self.heads, self.head_dim).swapaxes(1, 2)
            k = self.k_proj(x).reshape(batch, rows, self.kv_heads, self.head_dim).swapaxes(1, 2)
            v = self.v_proj(x).reshape(batch, rows, self.kv_heads, self.head_dim).swapaxes(1, 2)
            if hasattr(self, "q_norm"):  # per head vector: before or after the swap alike
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = kit.rotate(q, rotation), kit.rotate(k, rotation)
            if past is not None:
                k, v = kit.concat((past[0], k), 2), kit.concat((past[1], v), 2)
            out = kit.attend(q, k, v, mask).swapaxes(1, 2).reshape(batch, rows, -1)
            return self.o_proj(out), (k, v)

    class HeadMLP(kit.Module):
        def __init__(self, spec: EagleSpec) -> None:
            super().__init__()
            self.gate_proj = kit.linear(spec.hidden_size, spec.intermediate_size, False)
            self.up_proj = kit.linear(spec.hidden_size, spec.intermediate_size, False)
            self.down_proj = kit.linear(spec.intermediate_size, spec.hidden_size, False)
            self.act = kit.activation(spec.hidden_act, spec)

        def forward(self, x: Any) -> Any:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    class Eagle3Layer(kit.Module):
        """EAGLE-3's decoder layer: attention reads cat(input_layernorm(embed),
        hidden_norm(g))."""

        def __init__(self, spec: EagleSpec) -> None:
            super().__init__()
            self.norm_before_residual = spec.norm_before_residual
            self.input_layernorm = kit.rms_norm(spec.hidden_size, spec.rms_norm_eps)
            self.hidden_norm = kit.rms_norm(spec.hidden_size, spec.rms_norm_eps)
            self.self_attn = HeadAttention(spec, 2 * spec.hidden_size)
            self.post_attention_layernorm = kit.rms_norm(spec.hidden_size, spec.rms_norm_eps)
            self.mlp = HeadMLP(spec)

        def forward(self, embeds: Any, hidden: Any, rotation: Any, past: Any,
                    mask: Any) -> tuple[Any, Any]:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = kit.concat((self.input_layernorm(embeds), normed), -1)
            attn, present = self.self_attn(x, rotation, past, mask)
            h = residual + attn
            return h + self.mlp(self.post_attention_layernorm(h)), present

    class Eagle3Head(kit.Module):
        """One EAGLE-3 head; parameter names are the authors' (`midlayer.*`)."""

        def __init__(self, spec: EagleSpec) -> None:
            super().__init__()
            self.spec = spec
            width = spec.n_features * spec.target_hidden_size
            if spec.norm_before_fc:
                self.input_norm = kit.rms_norm(width, spec.rms_norm_eps)
            if spec.fc_norm:
                self.fc_norm = kit.modules([kit.rms_norm(spec.target_hidden_size,
                                                         spec.rms_norm_eps)
                                            for _ in range(spec.n_features)])
            self.fc = kit.linear(width, spec.hidden_size, spec.fc_bias)
            self.midlayer = Eagle3Layer(spec)
            self.norm = kit.rms_norm(spec.hidden_size, spec.rms_norm_eps)
            self.lm_head = kit.linear(spec.hidden_size, spec.draft_vocab_size, False)
            if spec.own_embed:
                self.embed_tokens = kit.embedding(spec.vocab_size, spec.hidden_size)
            self.rope = kit.rope(spec)
            # draft id + d2t = target id; t2d marks the target ids drafted (identity: all)
            kit.buffer(self, "d2t", np.zeros(spec.draft_vocab_size, dtype=np.int64))
            kit.buffer(self, "t2d", np.full(spec.vocab_size,
                                            spec.draft_vocab_size == spec.vocab_size))

        def project(self, states: Sequence[Any]) -> Any:
            """fc over the target's captured states, ascending layer order."""
            if hasattr(self, "fc_norm"):
                states = [norm(s) for norm, s in zip(self.fc_norm, states)]
            x = kit.concat(list(states), -1)
            if hasattr(self, "input_norm"):
                x = self.input_norm(x)
            return self.fc(x)

        def forward(self, embeds: Any, hidden: Any, positions: Any,
                    past: Sequence[Any] | None = None, mask: Any = None
                    ) -> tuple[Any, list[Any]]:
            rotation = self.rope(positions, embeds.dtype)
            h, present = self.midlayer(embeds, hidden, rotation, past[0] if past else None,
                                       mask)
            return h, [present]

        def logits(self, h: Any) -> Any:
            return self.lm_head(self.norm(h))

        def get_output_embeddings(self) -> Any:
            """The draft-vocabulary output layer (what a quantized target's head keeps int8)."""
            return self.lm_head

        def feedback(self, h: Any) -> Any:
            """The hidden state step j+1 reads: pre-norm, or post-norm for EAGLE 3.1 heads."""
            return self.norm(h) if self.spec.norm_output else h

        def to_target(self, draft_ids: Any) -> Any:
            return draft_ids + self.d2t[draft_ids]

        def own_embedding(self) -> Any:
            return getattr(self, "embed_tokens", None)

    class Eagle1Layer(kit.Module):
        """A Llama decoder layer; EAGLE-1's layer 0 has no input norm (fc output goes
        straight in)."""

        def __init__(self, spec: EagleSpec, index: int) -> None:
            super().__init__()
            if index:
                self.input_layernorm = kit.rms_norm(spec.hidden_size, spec.rms_norm_eps)
            self.self_attn = HeadAttention(spec, spec.hidden_size)
            self.post_attention_layernorm = kit.rms_norm(spec.hidden_size, spec.rms_norm_eps)
            self.mlp = HeadMLP(spec)

        def forward(self, x: Any, rotation: Any, past: Any, mask: Any) -> tuple[Any, Any]:
            normed = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
            attn, present = self.self_attn(normed, rotation, past, mask)
            h = x + attn
            return h + self.mlp(self.post_attention_layernorm(h)), present

    class Eagle1Head(kit.Module):
        """An EAGLE-1/2 head: fc(cat(embed, feature)) -> decoder layer(s); logits come from
        the target's own output layer (`use_target_head`)."""

        def __init__(self, spec: EagleSpec) -> None:
            super().__init__()
            self.spec = spec
            self.fc = kit.linear(2 * spec.hidden_size, spec.hidden_size, spec.fc_bias)
            self.layers = kit.modules([Eagle1Layer(spec, i) for i in range(spec.n_layers)])
            if spec.own_embed:
                self.embed_tokens = kit.embedding(spec.vocab_size, spec.hidden_size)
            self.rope = kit.rope(spec)
            self.use_target_head(None)

        def use_target_head(self, head: Callable[[Any], Any] | None) -> None:
            """Read logits through the target's output layer, without adopting it as a
            submodule (the head's parameters, dtype and device stay its own)."""
            object.__setattr__(self, "target_head", head)

        def get_output_embeddings(self) -> None:
            return None  # logits come from the target's layer

        def project(self, states: Sequence[Any]) -> Any:
            """The target's final post-norm state is the feature as it is."""
            return states[-1]

        def forward(self, embeds: Any, hidden: Any, positions: Any,
                    past: Sequence[Any] | None = None, mask: Any = None
                    ) -> tuple[Any, list[Any]]:
            rotation = self.rope(positions, embeds.dtype)
            x = self.fc(kit.concat((embeds, hidden), -1))
            present = []
            for i, layer in enumerate(self.layers):
                x, kv = layer(x, rotation, past[i] if past else None, mask)
                present.append(kv)
            return x, present

        def logits(self, h: Any) -> Any:
            return self.target_head(h)

        def feedback(self, h: Any) -> Any:
            return h

        def to_target(self, draft_ids: Any) -> Any:
            return draft_ids

        def own_embedding(self) -> Any:
            return getattr(self, "embed_tokens", None)

    return EagleModules(Eagle3Head, Eagle1Head)
