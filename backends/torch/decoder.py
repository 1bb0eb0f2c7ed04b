"""A lean forward for Llama-style decoders on CPU: transformers' own modules (norms, fused
projections, rotary embedding, output layer) called in the order its layers call them, over a
static KV cache, with row-wise attention.

Knows: the module names of transformers' Llama-family layers (Llama, Qwen2, Mistral; Qwen3,
whose queries and keys are normed per head before RoPE; Gemma 3, whose layers norm each
sublayer's output too, scale norms by 1 + w, gate with GELU and rotate by one RoPE per layer
type; Gemma 4's dense text decoder, which also norms its values without a scale, gives its
full layers their own head width and key heads, and in those takes the keys' projection as
the values (attention_k_eq_v), scales each layer's output by a scalar and caps its final
logits), each layer's cache geometry (sliding window, key heads, head width), sliding-window
layers (a row sees the window's last tokens up to its own; static_kv.py keeps the slots and
says which a row sees), torch ops, the row-wise attention rule of backends/torch/attention.py.
Must not know: drafting or verification rules, sessions' block splitting and padding
(session.py).

Why: at one row per forward the 1.5B Qwen's int4 decode step spent about 25 of its 95 ms
outside the matmuls: transformers' per-layer scaffolding (mask and position plumbing, cache
concatenation, kwargs, output objects, hooks), which llama.cpp does not pay. The math here is
the same ops on the same tensors, so a row gets the bits the transformers forward gives it:
every exactness promise (row invariance, tree rows equal to their chain twins) carries over.
One exception: a later prompt past the row-wise limit attends a sliding-window layer in one
masked call over the window's slots, where transformers' keys are what its cache kept, so
those rows may round differently (plain and speculative decoding share this forward, so the
tokens they give still match).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from backends.torch import lean_ops
from backends.torch.static_kv import Geometry, Keys, StaticKV, window_keys

# model types whose decoder layers are input norm, attention (q/k/v with optional bias, an
# optional per-head q/k norm, rope, o), a norm, gated MLP (Gemma 3 and 4: with a norm after
# each sublayer too; Gemma 4: a value norm, a layer scalar): the only layouts this computes
LLAMA_STYLE = frozenset({"llama", "qwen2", "mistral", "qwen3", "gemma3_text", "gemma4_text"})
OFFSET_NORMS = frozenset({"gemma3_text"})  # RMSNorm scales by 1 + weight, in float32
# final logits capped as their causal LM caps them (tanh of logits / cap, times cap): Gemma 4's
# checkpoints cap at 30; Gemma 3's cap nothing, so a capped one stays refused, untested
CAPPED = frozenset({"gemma4_text"})
# Gemma 4's text decoder features this forward does not compute, and why each is refused
GEMMA4_REFUSED = (("hidden_size_per_layer_input", "it feeds each layer an input of its own"),
                  ("enable_moe_block", "its layers add a mixture-of-experts block"))
ACTIVATIONS = frozenset({"silu", "gelu_pytorch_tanh"})
ATTENTION_TYPES = frozenset({"full_attention", "sliding_attention"})


def lean_reason(hf: Any) -> str | None:
    """None when this forward computes `hf` exactly as transformers does, else why not."""
    config = hf.config
    if config.model_type not in LLAMA_STYLE:
        return f"model type {config.model_type} is not a Llama-style decoder"
    if set(getattr(config, "layer_types", None) or ["full_attention"]) - ATTENTION_TYPES:
        return "it has recurrent layers"
    activation = getattr(config, "hidden_activation", None) or config.hidden_act
    if activation not in ACTIVATIONS:
        return f"its activation is {activation}"
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, cap, None) and not (cap.startswith("final")
                                               and config.model_type in CAPPED):
            return f"it caps its logits ({cap})"
    # Gemma 4's "vision" lets image tokens attend both ways in the multimodal model only: its
    # text decoder masks causally
    if getattr(config, "use_bidirectional_attention", None) not in (None, False, "vision"):
        return "it attends both ways (use_bidirectional_attention)"
    refused = _gemma4_refusal(config)
    if refused is not None:
        return refused
    for layer in hf.model.layers:
        attention = layer.self_attn
        if not ((hasattr(attention, "qkv_fused") or hasattr(attention, "qk_fused"))
                and hasattr(layer.mlp, "gate_up_fused")):
            return "its projections are not fused"
    return None


def _gemma4_refusal(config: Any) -> str | None:
    """Why this forward does not compute a Gemma 4 text decoder (its per-layer inputs, MoE
    blocks or shared keys and values: E2B, E4B, 26B-A4B), None where it does or for others."""
    if config.model_type != "gemma4_text":
        return None
    for name, why in GEMMA4_REFUSED:
        if getattr(config, name, None):
            return f"{why} ({name})"
    if "reuse" in config.kv_sharing_modes:
        return "its last layers reuse earlier layers' keys and values (num_kv_shared_layers)"
    return None


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers' masks read the
    config: the layers layer_types names sliding, or every layer where it names none."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return [None] * int(config.num_hidden_layers)
    if types is None:
        return [int(window)] * int(config.num_hidden_layers)
    return [int(window) if kind == "sliding_attention" else None for kind in types]


def layer_geometry(hf: Any) -> list[Geometry]:
    """Each layer's Geometry, read from its attention module: Gemma 4's full layers have wider
    heads and fewer key heads than its sliding ones (config.per_layer_config)."""
    heads = int(hf.config.num_attention_heads)
    return [Geometry(window, heads // int(layer.self_attn.num_key_value_groups),
                     int(layer.self_attn.head_dim))
            for layer, window in zip(hf.model.layers, layer_windows(hf.config))]


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.nn.Module
    qkv: torch.nn.Module  # q, k, v fused; q, k only where the values are the keys
    o_proj: torch.nn.Module
    post_norm: torch.nn.Module  # the MLP's input norm
    gate_up: torch.nn.Module
    down_proj: torch.nn.Module
    intermediate: int
    q_norm: torch.nn.Module | None  # Qwen3's and Gemma's per-head norms, before RoPE
    k_norm: torch.nn.Module | None
    act: torch.nn.Module  # the gate's activation
    silu: bool
    attention_out_norm: torch.nn.Module | None  # Gemma's norms of each sublayer's output
    mlp_out_norm: torch.nn.Module | None
    rope: str | None  # the layer type whose RoPE rotates it, where they differ by type
    heads: int
    geometry: Geometry
    v_norm: torch.nn.Module | None  # Gemma 4's scale-free norm of the values
    values_are_keys: bool  # Gemma 4's attention_k_eq_v full layers: no v_proj
    scalar: torch.Tensor | None  # Gemma 4's layer_scalar, times the layer's output
    attention: torch.nn.Module  # sdpa_attention_forward reads its flags (groups, causal)
    scaling: float

    @property
    def window(self) -> int | None:
        return self.geometry.window


def _layer(layer: Any, heads: int, geometry: Geometry, rope: str | None, silu: bool) -> _Layer:
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    attention = layer.self_attn
    # a v_proj set to None (not absent): Gemma 4's values are its keys' projection
    values_are_keys = getattr(attention, "v_proj", True) is None
    fused = attention.qk_fused if values_are_keys else attention.qkv_fused
    return _Layer(
        layer.input_layernorm, fused.layer, attention.o_proj,
        layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
        layer.mlp.gate_up_fused.layer, layer.mlp.down_proj, int(layer.mlp.gate_up_fused.sizes[0]),
        getattr(attention, "q_norm", None), getattr(attention, "k_norm", None),
        layer.mlp.act_fn, silu, layer.post_attention_layernorm if sandwich else None,
        layer.post_feedforward_layernorm if sandwich else None, rope, heads, geometry,
        getattr(attention, "v_norm", None), values_are_keys,
        getattr(layer, "layer_scalar", None), attention, float(attention.scaling))


@dataclass(frozen=True)
class Segment:
    """One cache's rows in a forward: their ids, positions and visible slots (decoder.forward's
    arguments); its keys and values land in slots cache.length onwards."""

    cache: StaticKV
    ids: tuple[int, ...]
    positions: tuple[int, ...]
    keys: Sequence[Keys] | None
    n_logits: int


class LeanDecoder:
    """The forward of a Llama-style transformers model, module by module, on a StaticKV."""

    def __init__(self, hf: Any) -> None:
        config = hf.config
        self._hf = hf
        heads = int(config.num_attention_heads)
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        # Gemma 3 and 4 rotate each layer type by its own RoPE (local and global bases)
        by_type = isinstance(getattr(hf.model.rotary_emb, "rope_type", None), dict)
        types = list(getattr(config, "layer_types", None) or [])
        self._layers = [_layer(layer, heads, shape, types[i] if by_type else None,
                               activation == "silu")
                        for i, (layer, shape) in enumerate(zip(hf.model.layers,
                                                               layer_geometry(hf)))]
        cap = getattr(config, "final_logit_softcapping", None)
        self._cap = float(cap) if cap and config.model_type in CAPPED else None
        offset = config.model_type in OFFSET_NORMS
        # (weight, eps) of each layer's input norm, then of the final norm; each MLP input
        # norm's; each sublayer output norm's (Gemma)
        self._norms = [_weight_eps(layer.input_norm, offset) for layer in self._layers] + [
            _weight_eps(hf.model.norm, offset)]
        self._post_norms = [_weight_eps(layer.post_norm, offset) for layer in self._layers]
        self._out_norms = [
            tuple(_weight_eps(norm, offset) if norm is not None else None
                  for norm in (layer.attention_out_norm, layer.mlp_out_norm))
            for layer in self._layers]
        self.in_c = _in_c(hf, self._layers)

    def new_cache(self, limit: int) -> StaticKV:
        """An empty cache that grows up to `limit` slots (the model's context length)."""
        return StaticKV([layer.geometry for layer in self._layers], self._hf.dtype, limit)

    def forward(self, cache: StaticKV, token_ids: Sequence[int], positions: Sequence[int],
                keys: Sequence[Keys] | None, n_logits: int, capture: Iterable[int] = (),
                head: torch.nn.Module | None = None,
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits [n_logits, vocab] of the last rows and the captured layers' outputs [rows,
        hidden]; the rows' keys and values land in slots cache.length onwards, and
        cache.length advances by the rows. `keys` names each row's visible slots (None: a
        causal prompt, attended in one call); `head` replaces the model's output layer (and
        its final cap: a session owns a head only where the logits are the head's alone)."""
        segment = Segment(cache, tuple(token_ids), tuple(positions), keys, n_logits)
        return self.forward_segments([segment], capture, head)[0]

    @torch.inference_mode()
    def forward_segments(self, segments: Sequence[Segment], capture: Iterable[int] = (),
                         head: torch.nn.Module | None = None
                         ) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """forward's contract for several caches at once (batched streams): every matmul
        runs over all segments' rows, attention over each segment's own cache. Each row's
        bits are those it gets alone wherever the matmuls are row-invariant (the load-time
        check), since attention and the steps between matmuls are row-wise."""
        spans, at = [], 0
        for segment in segments:
            segment.cache.reserve(segment.cache.length + len(segment.ids))
            spans.append((at, at + len(segment.ids), segment.cache.length))
            at += len(segment.ids)
        ids = [t for segment in segments for t in segment.ids]
        positions = [p for segment in segments for p in segment.positions]
        want = frozenset(capture)
        run = self._layers_in_c if self.in_c else self._layers_in_torch
        x, normed, captured = run(segments, spans, ids, positions, want)
        for segment in segments:
            segment.cache.length += len(segment.ids)
        return self._outputs(segments, spans, x, normed, captured, head)

    def _outputs(self, segments: Sequence[Segment], spans: list[tuple[int, int, int]],
                 x: torch.Tensor, normed: torch.Tensor | None,
                 captured: dict[int, torch.Tensor], head: torch.nn.Module | None
                 ) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """Each segment's logits (its last n_logits rows, one output-layer call for all) and
        its rows of the captured layers."""
        rows = [r for (_, end, _), segment in zip(spans, segments)
                for r in range(end - segment.n_logits, end)]
        capped = self._cap if head is None else None
        head = self._hf.get_output_embeddings() if head is None else head
        # the final norm over the kept rows only, as transformers computes it
        last = normed[rows] if normed is not None else self._hf.model.norm(x[rows])
        logits = head(last) if rows else x[:0]
        if capped is not None and rows:
            # Gemma 4's causal LM's three ops, so each logit gets its bits
            logits = torch.tanh(logits / capped) * capped
        out, at = [], 0
        for (start, end, _), segment in zip(spans, segments):
            mine = logits[at:at + segment.n_logits] if segment.n_logits else x[:0]
            at += segment.n_logits
            out.append((mine, {i: h[start:end] for i, h in captured.items()}))
        return out

    def _ropes(self, x: torch.Tensor, positions: list[int]
               ) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [rows, dim] of the rows' positions, per RoPE the layers use (Gemma 4's
        full layers' is as wide as their heads, its unrotated part cos 1 and sin 0)."""
        model, at = self._hf.model, torch.tensor([positions])
        out = {}
        for kind in dict.fromkeys(layer.rope for layer in self._layers):
            cos, sin = (model.rotary_emb(x[None], at) if kind is None
                        else model.rotary_emb(x[None], at, kind))
            out[kind] = cos[0], sin[0]
        return out

    def _layers_in_torch(self, segments: Sequence[Segment], spans: list[tuple[int, int, int]],
                         ids: list[int], positions: list[int], want: frozenset[int]
                         ) -> tuple[torch.Tensor, None, dict[int, torch.Tensor]]:
        x = self._hf.model.embed_tokens(torch.tensor(ids, dtype=torch.long))
        # [rows, 1, dim]: broadcast over heads
        ropes = {kind: (cos[:, None], sin[:, None])
                 for kind, (cos, sin) in self._ropes(x, positions).items()}
        captured: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self._layers):
            qk, v = _split(layer, layer.qkv(layer.input_norm(x)))
            cos, sin = ropes[layer.rope]
            attended = torch.cat([
                self._attention(qk[start:end], v[start:end], index, segment.cache, first,
                                cos[start:end], sin[start:end], segment.keys)
                for (start, end, first), segment in zip(spans, segments)])
            out = layer.o_proj(attended)
            if layer.attention_out_norm is not None:
                out = layer.attention_out_norm(out)
            x = x + out
            gate_up = layer.gate_up(layer.post_norm(x))
            gate, up = gate_up.narrow(-1, 0, layer.intermediate), gate_up.narrow(
                -1, layer.intermediate, layer.intermediate)
            out = layer.down_proj(layer.act(gate) * up)
            if layer.mlp_out_norm is not None:
                out = layer.mlp_out_norm(out)
            x = x + out
            if layer.scalar is not None:
                x = x * layer.scalar
            if index in want:
                captured[index] = x
        return x, None, captured

    def _layers_in_c(self, segments: Sequence[Segment], spans: list[tuple[int, int, int]],
                     ids: list[int], positions: list[int], want: frozenset[int]
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The layers with the steps between matmuls in lean_ops' C: a prompt's rows (keys
        None) attend as a chain's do, each to the slots up to its own."""
        x = self._hf.model.embed_tokens(torch.tensor(ids, dtype=torch.long)).contiguous()
        ropes = {kind: (cos.contiguous(), sin.contiguous())
                 for kind, (cos, sin) in self._ropes(x, positions).items()}
        windows = set(layer.window for layer in self._layers)
        slots = [{w: lean_ops.Slots.of(
                      segment.keys if w is None else window_keys(
                          segment.keys, first, end - start, w, segment.cache.offset(w)),
                      first, end - start) for w in windows}
                 for (start, end, first), segment in zip(spans, segments)]
        captured: dict[int, torch.Tensor] = {}
        normed = lean_ops.rmsnorm(x, *self._norms[0])
        for index, layer in enumerate(self._layers):
            heads, kv_heads, dim = layer.heads, layer.geometry.kv_heads, layer.geometry.head_dim
            qkv = _normed_qkv(layer, layer.qkv(normed))
            lean_ops.rope(qkv, heads + kv_heads, dim, *ropes[layer.rope])
            parts = []
            for (start, end, first), segment, seen in zip(spans, segments, slots):
                rows = qkv[start:end]
                layer_keys, layer_values, offset = segment.cache.layer(index)
                lean_ops.store_kv(rows, heads * dim, (heads + kv_heads) * dim, kv_heads, dim,
                                  layer_keys, layer_values, first - offset)
                parts.append(lean_ops.attention(rows, heads, kv_heads, dim, layer_keys,
                                                layer_values, seen[layer.window],
                                                layer.scaling))
            attended = parts[0] if len(parts) == 1 else torch.cat(parts)
            attention_out, mlp_out = self._out_norms[index]
            out = layer.o_proj(attended)
            if attention_out is not None:
                out = lean_ops.rmsnorm(out, *attention_out)
            x, normed = lean_ops.add_rmsnorm(x, out, *self._post_norms[index])
            down = layer.down_proj(self._gated(layer, layer.gate_up(normed)))
            if mlp_out is not None:
                down = lean_ops.rmsnorm(down, *mlp_out)
            # the next layer's input norm, or the final norm after the last layer
            x, normed = lean_ops.add_rmsnorm(x, down, *self._norms[index + 1])
            if index in want:
                captured[index] = x
        return x, normed, captured

    @staticmethod
    def _gated(layer: _Layer, gate_up: torch.Tensor) -> torch.Tensor:
        if layer.silu:
            return lean_ops.silu_mul(gate_up, layer.intermediate)
        gate, up = gate_up.narrow(-1, 0, layer.intermediate), gate_up.narrow(
            -1, layer.intermediate, layer.intermediate)
        return (layer.act(gate) * up).contiguous()

    def _attention(self, qk: torch.Tensor, v: torch.Tensor, index: int, cache: StaticKV,
                   first: int, cos: torch.Tensor, sin: torch.Tensor,
                   keys: Sequence[Keys] | None) -> torch.Tensor:
        layer = self._layers[index]
        n, heads, kv_heads, dim = qk.shape[0], layer.heads, layer.geometry.kv_heads, \
            layer.geometry.head_dim
        # queries and keys rotate as one tensor: elementwise, so each gets its own bits
        qk = _rotary(qk, cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        layer_keys, layer_values, offset = cache.layer(index)
        window = layer.window
        at, end = first - offset, first - offset + n
        layer_keys[:, at:end] = k.transpose(0, 1)
        layer_values[:, at:end] = v.transpose(0, 1)
        if keys is None:
            # a first prompt attends to its own rows as transformers hands them over (SDPA's
            # bits depend on the strides of its keys); a later one to the cache's slots
            start = 0 if window is None or first == 0 else max(0, first - window + 1) - offset
            key, value = ((k.contiguous().transpose(0, 1)[None], v.transpose(0, 1)[None])
                          if first == 0 else
                          (layer_keys[None, :, start:end].contiguous(),
                           layer_values[None, :, start:end].contiguous()))
            out, _ = sdpa_attention_forward(layer.attention, q.contiguous().transpose(0, 1)[None],
                                            key, value,
                                            _prompt_mask(n, first, start + offset, window),
                                            scaling=layer.scaling)
            return out.reshape(n, heads * dim)
        if window is not None:
            keys = window_keys(keys, first, n, window, offset)
        key, value = layer_keys[None, :, :end], layer_values[None, :, :end]
        packed = q.view(n, kv_heads, heads // kv_heads, dim)
        rows = [F.scaled_dot_product_attention(packed[r][None], key[:, :, seen],
                                               value[:, :, seen], scale=layer.scaling)
                for r, seen in enumerate(keys)]
        return (rows[0] if n == 1 else torch.stack(rows)).reshape(n, heads * dim)


def _split(layer: _Layer, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys [rows, heads + kv heads, dim] before RoPE, values [rows, kv heads,
    dim], as transformers hands them on: queries and keys normed per head where the layer
    norms them (Qwen3, Gemma), values normed (Gemma 4) in their own tensor (SDPA reads its
    strides) or, where they are the keys, the keys' projection before its norm."""
    heads, kv_heads, dim = layer.heads, layer.geometry.kv_heads, layer.geometry.head_dim
    n = qkv.shape[0]
    keys = qkv.narrow(-1, heads * dim, kv_heads * dim).view(n, kv_heads, dim)
    v = keys if layer.values_are_keys else qkv.narrow(
        -1, (heads + kv_heads) * dim, kv_heads * dim).view(n, kv_heads, dim)
    if layer.v_norm is not None:
        v = layer.v_norm(v)
    if layer.q_norm is None or layer.k_norm is None:
        return qkv.narrow(-1, 0, (heads + kv_heads) * dim).view(n, heads + kv_heads, dim), v
    q = layer.q_norm(qkv.narrow(-1, 0, heads * dim).view(n, heads, dim))
    return torch.cat([q, layer.k_norm(keys)], dim=1), v


def _normed_qkv(layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
    """qkv as lean_ops reads it, [rows, (heads + 2 kv heads) * dim], its queries and keys
    normed per head where the layer norms them; unchanged without norms."""
    if layer.q_norm is None or layer.k_norm is None:
        return qkv
    qk, v = _split(layer, qkv)
    n = qkv.shape[0]
    return torch.cat([qk.reshape(n, -1), v.reshape(n, -1)], dim=-1)


def _prompt_mask(n: int, first: int, lead: int, window: int | None) -> torch.Tensor | None:
    """[1, 1, n, keys] which keys (tokens lead..first + n - 1) each prompt row at first + r
    sees, as transformers masks a prompt; None where it lets SDPA be causal itself (a first
    prompt, shorter than any window)."""
    if first == 0 and (window is None or n < window):
        return None
    rows = torch.arange(first, first + n)[:, None]
    tokens = torch.arange(lead, first + n)[None, :]
    seen = tokens <= rows
    if window is not None:
        seen &= tokens > rows - window
    return seen[None, None]


def _weight_eps(norm: torch.nn.Module, offset: bool) -> tuple[torch.Tensor, float]:
    """The weight the C norm multiplies by, and the norm's epsilon (Gemma's: 1 + w)."""
    if offset:
        return (1.0 + norm.weight.float()).contiguous(), float(norm.eps)
    return norm.weight, float(norm.variance_epsilon)


def _in_c(hf: Any, layers: Sequence[_Layer]) -> bool:
    """Whether lean_ops computes the steps between matmuls: a GGUF model's float32 forward
    (no transformers forward to match bit for bit) where the kernel runs, its widths fit and
    its layers need no step the C lacks (Gemma 4's value norms, layer scalars, values that
    are the keys: no GGUF of it loads on the blocks path, gguf_model.py)."""
    hidden = int(hf.config.hidden_size)
    plain = all(layer.v_norm is None and layer.scalar is None and not layer.values_are_keys
                and lean_ops.fits(hidden, layer.intermediate, layer.geometry.head_dim)
                for layer in layers)
    return (getattr(hf, "gguf_tensors", None) is not None and hf.dtype == torch.float32
            and plain and lean_ops.is_available())


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb, elementwise the same, on [rows, heads, dim]."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
