"""A lean forward for Llama-style decoders on CPU: transformers' own modules (norms, fused
projections, rotary embedding, output layer) called in the order its layers call them, over a
static KV cache, with row-wise attention.

Knows: the module names of transformers' Llama-family layers (Llama, Qwen2, Mistral without a
sliding window; Qwen3, whose queries and keys are normed per head before RoPE), torch ops, the
row-wise attention rule of backends/torch/attention.py. Must not know: drafting or verification
rules, sessions' block splitting and padding (session.py).

Why: at one row per forward the 1.5B Qwen's int4 decode step spent about 25 of its 95 ms
outside the matmuls: transformers' per-layer scaffolding (mask and position plumbing, cache
concatenation, kwargs, output objects, hooks), which llama.cpp does not pay. The math here is
the same ops on the same tensors, so a row gets the bits the transformers forward gives it:
every exactness promise (row invariance, tree rows equal to their chain twins) carries over.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from backends.torch import lean_ops
from backends.torch.attention import MAX_ROWWISE_ROWS

# model types whose decoder layers are input norm, attention (q/k/v with optional bias, an
# optional per-head q/k norm, rope, o), post-attention norm, gated MLP: the only layout this
# forward computes
LLAMA_STYLE = frozenset({"llama", "qwen2", "mistral", "qwen3"})
FIRST_CAPACITY = 512  # cache slots allocated at first; doubled as the sequence grows

Keys = slice | torch.Tensor  # the cache slots one query row attends to


def lean_reason(hf: Any) -> str | None:
    """None when this forward computes `hf` exactly as transformers does, else why not."""
    config = hf.config
    if config.model_type not in LLAMA_STYLE:
        return f"model type {config.model_type} is not a Llama-style decoder"
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return "it has sliding-window or recurrent layers"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "it attends through a sliding window"
    if config.hidden_act != "silu":
        return f"its activation is {config.hidden_act}"
    for layer in hf.model.layers:
        if not (hasattr(layer.self_attn, "qkv_fused") and hasattr(layer.mlp, "gate_up_fused")):
            return "its projections are not fused"
    return None


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.nn.Module
    qkv: torch.nn.Module
    o_proj: torch.nn.Module
    post_norm: torch.nn.Module
    gate_up: torch.nn.Module
    down_proj: torch.nn.Module
    intermediate: int
    q_norm: torch.nn.Module | None  # Qwen3's per-head norms, before RoPE; None for Llama's
    k_norm: torch.nn.Module | None


class StaticKV:
    """Keys and values of every layer in preallocated slots [layers, kv heads, slots, dim];
    slot i holds the sequence's i-th token. Cutting back is setting `length`."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 limit: int) -> None:
        self.limit = limit
        self.length = 0
        shape = (n_layers, kv_heads, min(FIRST_CAPACITY, limit), head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)

    def reserve(self, slots: int) -> None:
        """Room for `slots` tokens in all (doubling, up to the context length)."""
        have = self.keys.shape[2]
        if slots <= have:
            return
        size = min(max(slots, 2 * have), max(self.limit, slots))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], size, old.shape[3]))
            new[:, :, :have] = old
            setattr(self, name, new)

    def select(self, length: int, slots: Sequence[int]) -> None:
        """Keep the first `length` tokens, then the tokens in `slots` (ascending), in order."""
        index = torch.tensor(list(slots), dtype=torch.long)
        end = length + len(index)
        # slots grown inside a forward are inference tensors, writable only in inference mode
        # (a tree's kept path after a 600-token rag prompt raised here, outside it)
        with torch.inference_mode():
            self.keys[:, :, length:end] = self.keys.index_select(2, index)
            self.values[:, :, length:end] = self.values.index_select(2, index)
        self.length = end


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
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // config.num_attention_heads)
        self._layers = [_Layer(layer.input_layernorm, layer.self_attn.qkv_fused.layer,
                               layer.self_attn.o_proj, layer.post_attention_layernorm,
                               layer.mlp.gate_up_fused.layer, layer.mlp.down_proj,
                               int(layer.mlp.gate_up_fused.sizes[0]),
                               getattr(layer.self_attn, "q_norm", None),
                               getattr(layer.self_attn, "k_norm", None))
                        for layer in hf.model.layers]
        self._scaling = float(hf.model.layers[0].self_attn.scaling)
        self._attn = hf.model.layers[0].self_attn  # sdpa_attention_forward reads its flags
        # (weight, eps) of each layer's input norm, then of the final norm; each post norm's
        self._norms = [_weight_eps(layer.input_norm) for layer in self._layers] + [
            _weight_eps(hf.model.norm)]
        self._post_norms = [_weight_eps(layer.post_norm) for layer in self._layers]
        self.in_c = _in_c(hf, self.head_dim, self._layers[0].intermediate)

    def new_cache(self, limit: int) -> StaticKV:
        """An empty cache that grows up to `limit` slots (the model's context length)."""
        return StaticKV(len(self._layers), self.kv_heads, self.head_dim, self._hf.dtype, limit)

    def forward(self, cache: StaticKV, token_ids: Sequence[int], positions: Sequence[int],
                keys: Sequence[Keys] | None, n_logits: int, capture: Iterable[int] = (),
                head: torch.nn.Module | None = None,
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits [n_logits, vocab] of the last rows and the captured layers' outputs [rows,
        hidden]; the rows' keys and values land in slots cache.length onwards, and
        cache.length advances by the rows. `keys` names each row's visible slots (None: a
        causal prompt, attended in one call); `head` replaces the model's output layer."""
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
        head = self._hf.get_output_embeddings() if head is None else head
        # the final norm over the kept rows only, as transformers computes it
        last = normed[rows] if normed is not None else self._hf.model.norm(x[rows])
        logits = head(last) if rows else x[:0]
        out, at = [], 0
        for (start, end, _), segment in zip(spans, segments):
            mine = logits[at:at + segment.n_logits] if segment.n_logits else x[:0]
            at += segment.n_logits
            out.append((mine, {i: h[start:end] for i, h in captured.items()}))
        return out

    def _layers_in_torch(self, segments: Sequence[Segment], spans: list[tuple[int, int, int]],
                         ids: list[int], positions: list[int], want: frozenset[int]
                         ) -> tuple[torch.Tensor, None, dict[int, torch.Tensor]]:
        model = self._hf.model
        x = model.embed_tokens(torch.tensor(ids, dtype=torch.long))
        cos, sin = model.rotary_emb(x[None], torch.tensor([positions]))
        cos, sin = cos[0, :, None], sin[0, :, None]  # [rows, 1, dim]: broadcast over heads
        captured: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self._layers):
            qkv = self._head_norms(layer, layer.qkv(layer.input_norm(x)))
            attended = torch.cat([
                self._attention(qkv[start:end], index, segment.cache, first, cos[start:end],
                                sin[start:end], segment.keys)
                for (start, end, first), segment in zip(spans, segments)])
            x = x + layer.o_proj(attended)
            gate_up = layer.gate_up(layer.post_norm(x))
            gate, up = gate_up.narrow(-1, 0, layer.intermediate), gate_up.narrow(
                -1, layer.intermediate, layer.intermediate)
            x = x + layer.down_proj(F.silu(gate) * up)
            if index in want:
                captured[index] = x
        return x, None, captured

    def _layers_in_c(self, segments: Sequence[Segment], spans: list[tuple[int, int, int]],
                     ids: list[int], positions: list[int], want: frozenset[int]
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The layers with the steps between matmuls in lean_ops' C: a prompt's rows (keys
        None) attend as a chain's do, each to the slots up to its own."""
        model, heads, kv_heads, dim = self._hf.model, self.heads, self.kv_heads, self.head_dim
        x = model.embed_tokens(torch.tensor(ids, dtype=torch.long)).contiguous()
        cos, sin = model.rotary_emb(x[None], torch.tensor([positions]))
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [rows, dim]
        slots = [lean_ops.Slots.of(segment.keys, first, end - start)
                 for (start, end, first), segment in zip(spans, segments)]
        captured: dict[int, torch.Tensor] = {}
        normed = lean_ops.rmsnorm(x, *self._norms[0])
        for index, layer in enumerate(self._layers):
            qkv = self._head_norms(layer, layer.qkv(normed))
            lean_ops.rope(qkv, heads + kv_heads, dim, cos, sin)
            parts = []
            for (start, end, first), segment, seen in zip(spans, segments, slots):
                rows = qkv[start:end]
                layer_keys = segment.cache.keys[index]
                layer_values = segment.cache.values[index]
                lean_ops.store_kv(rows, heads * dim, (heads + kv_heads) * dim, kv_heads, dim,
                                  layer_keys, layer_values, first)
                parts.append(lean_ops.attention(rows, heads, kv_heads, dim, layer_keys,
                                                layer_values, seen, self._scaling))
            attended = parts[0] if len(parts) == 1 else torch.cat(parts)
            x, normed = lean_ops.add_rmsnorm(x, layer.o_proj(attended),
                                             *self._post_norms[index])
            down = layer.down_proj(lean_ops.silu_mul(layer.gate_up(normed), layer.intermediate))
            # the next layer's input norm, or the final norm after the last layer
            x, normed = lean_ops.add_rmsnorm(x, down, *self._norms[index + 1])
            if index in want:
                captured[index] = x
        return x, normed, captured

    def _head_norms(self, layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with its queries and keys normed per head (Qwen3), as transformers norms the
        q and k projections' outputs viewed as [rows, heads, dim]; unchanged without norms."""
        if layer.q_norm is None or layer.k_norm is None:
            return qkv
        n, heads, kv_heads, dim = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        q = layer.q_norm(qkv.narrow(-1, 0, heads * dim).view(n, heads, dim))
        k = layer.k_norm(qkv.narrow(-1, heads * dim, kv_heads * dim).view(n, kv_heads, dim))
        v = qkv.narrow(-1, (heads + kv_heads) * dim, kv_heads * dim)
        return torch.cat([q.reshape(n, heads * dim), k.reshape(n, kv_heads * dim), v], dim=-1)

    def _attention(self, qkv: torch.Tensor, index: int, cache: StaticKV, first: int,
                   cos: torch.Tensor, sin: torch.Tensor,
                   keys: Sequence[Keys] | None) -> torch.Tensor:
        n, heads, kv_heads, dim = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        # queries and keys rotate as one tensor: elementwise, so each gets its own bits
        qk = _rotary(qkv.narrow(-1, 0, (heads + kv_heads) * dim).view(n, heads + kv_heads, dim),
                     cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv.narrow(-1, (heads + kv_heads) * dim, kv_heads * dim).view(n, kv_heads, dim)
        end = first + n
        cache.keys[index, :, first:end] = k.transpose(0, 1)
        cache.values[index, :, first:end] = v.transpose(0, 1)
        if keys is None:
            # a first prompt attends to its own rows as transformers hands them over (SDPA's
            # bits depend on the strides of its keys); a later one to the cache's slots
            key, value = ((k.contiguous().transpose(0, 1)[None], v.transpose(0, 1)[None])
                          if first == 0 else
                          (cache.keys[index, None, :, :end].contiguous(),
                           cache.values[index, None, :, :end].contiguous()))
            return self._prompt_attention(q.contiguous(), key, value, first)
        key, value = cache.keys[index, None, :, :end], cache.values[index, None, :, :end]
        packed = q.view(n, kv_heads, heads // kv_heads, dim)
        rows = [F.scaled_dot_product_attention(packed[r][None], key[:, :, seen],
                                               value[:, :, seen], scale=self._scaling)
                for r, seen in enumerate(keys)]
        return (rows[0] if n == 1 else torch.stack(rows)).reshape(n, heads * dim)

    def _prompt_attention(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          first: int) -> torch.Tensor:
        n, end = q.shape[0], key.shape[2]
        # transformers drops the mask of a first prompt and lets SDPA be causal itself
        mask = (None if first == 0 else
                torch.ones((n, end), dtype=torch.bool).tril(diagonal=first)[None, None])
        out, _ = sdpa_attention_forward(self._attn, q.transpose(0, 1)[None], key, value, mask,
                                        scaling=self._scaling)
        return out.reshape(n, self.heads * self.head_dim)


def _weight_eps(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    return norm.weight, float(norm.variance_epsilon)


def _in_c(hf: Any, head_dim: int, intermediate: int) -> bool:
    """Whether lean_ops computes the steps between matmuls: a GGUF model's float32 forward
    (no transformers forward to match bit for bit) where the kernel runs and its widths fit."""
    return (getattr(hf, "gguf_tensors", None) is not None and hf.dtype == torch.float32
            and lean_ops.fits(int(hf.config.hidden_size), intermediate, head_dim)
            and lean_ops.is_available())


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb, elementwise the same, on [rows, heads, dim]."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def chain_keys(first: int, n: int) -> list[Keys] | None:
    """Each row of a chain sees every slot up to its own; None for a prompt (one causal
    call, as transformers computes it past the row-wise limit)."""
    if n > MAX_ROWWISE_ROWS:
        return None
    return [slice(0, first + r + 1) for r in range(n)]


def tree_keys(parents: Sequence[int], base: int, start: int, end: int, pad: int) -> list[Keys]:
    """Rows start..end of a tree whose row 0 sits in slot `base`: the prefix and the row's
    ancestors in slot order (a slice where contiguous); padding rows see the prefix and
    themselves."""
    out: list[Keys] = []
    for r in range(start, end):
        path, node = [], r
        while node >= 0:
            path.append(base + node)
            node = parents[node]
        path.reverse()
        out.append(_slots(base, path))
    out += [_slots(base, [base + end + i]) for i in range(pad)]
    return out


def _slots(base: int, extra: list[int]) -> Keys:
    if extra == list(range(base, base + len(extra))):
        return slice(0, base + len(extra))
    return torch.tensor([*range(base), *extra], dtype=torch.long)


def tree_positions(parents: Sequence[int], base: int, start: int, end: int,
                   pad: int) -> list[int]:
    """Position ids of rows start..end (cache length + depth), then of padding rows."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    positions = [base + d for d in depth[start:end]]
    return positions + [positions[-1] + 1 + i for i in range(pad)]
