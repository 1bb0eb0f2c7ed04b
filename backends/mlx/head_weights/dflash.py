"""DFlash (1 and 2) block drafters on MLX: the weight modules, and the block drafter
(backends/heads/dflash_drafter.py) built on them from the same folders torch loads.

Knows: the drafter's layers as mlx modules (HEADS.md §3.2, the math of
backends/torch/head_weights/dflash.py and dflash2.py, held to the reference there and here): the
target features of committed rows enter every draft layer only as keys and values through
the same k/v projections as the block, which attends to them, to its cache and to itself
without a causal mask; DFlash 2's grouped dynamic causal convolution around each sublayer and
its selector's weights; mlx-lm's RoPE and MLP; mx.load of safetensors. Must not know: the
folder's format (backends/heads/dflash_format.py), drafting (backends/heads/dflash_drafter.py),
the engine's loop.

Keys and values are kept per layer as [kv_heads, rows, head_dim] pairs (the torch layout), so
the drafter crops both backends' caches alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from app.core.types import SpecdeckError
from backends.heads.dflash_drafter import BlockDrafter
from backends.heads.dflash_format import (
    DFlash2Config,
    DFlashSpec,
    check_tensors,
    module_names,
    read_spec,
)
from backends.mlx.arrays import MlxArrays
from backends.mlx.head_weights.eagle import RMSNorm, target_parts

KV = tuple[mx.array, mx.array]


class GroupedCausalConv(nn.Module):
    """The convolution pair around one sublayer: `prepare` before it, `finish` after."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size),
                                           bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [rows, H] -> (x convolved, the dynamic kernel `finish` uses)."""
        dynamic = self.kernel_projection(x).reshape(x.shape[0], 2, self.kernel_size, -1)
        return self._convolve(x, dynamic[:, 0], 0), dynamic[:, 1]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return self._convolve(x, dynamic, 1)

    def _convolve(self, x: mx.array, dynamic: mx.array, which: int) -> mx.array:
        # weights[t, o, c] = base[o, c] + dynamic[t, o, c's group]
        weights = self.base_kernel[which].astype(x.dtype) + \
            mx.repeat(dynamic, self.group_size, axis=-1)
        rows = x.shape[0]
        out = weights[:, 0] * x
        for offset in range(1, min(self.kernel_size, rows)):  # row t reads row t - offset
            shifted = mx.concatenate([mx.zeros((offset, x.shape[1]), dtype=x.dtype),
                                      x[:rows - offset]])
            out = out + weights[:, offset] * shifted
        return out


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose keys and values also cover the injected context; parameter
    names are torch's (attention projections beside the MLP)."""

    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        hidden, eps, dim = spec.hidden_size, float(spec.get("rms_norm_eps", 1e-6)), \
            spec.head_dim
        self.heads, self.kv_heads = int(spec.get("num_attention_heads")), \
            int(spec.get("num_key_value_heads"))
        self.head_dim, bias = dim, bool(spec.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.heads * dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * dim, hidden, bias=bias)
        self.q_norm, self.k_norm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.mlp = MLP(hidden, int(spec.get("intermediate_size")))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if spec.version2:
            shape = spec.version2
            self.attention_conv = GroupedCausalConv(hidden, shape.kernel_size, shape.group_size)
            self.mlp_conv = GroupedCausalConv(hidden, shape.kernel_size, shape.group_size)

    def __call__(self, x: mx.array, ctx: mx.array, rope: Any, start: int,
                 past: KV | None) -> tuple[mx.array, KV]:
        """x [B, H] block rows, ctx [C, H] new context rows at positions start.. and the block
        after them. Returns the block's output and the keys/values of past + context +
        block."""
        rows = x.shape[0]
        h, kernel = self._before("attention_conv", self.input_layernorm(x))
        both = mx.concatenate([ctx, h])
        q = self.q_norm(self.q_proj(h).reshape(rows, self.heads, -1)).swapaxes(0, 1)
        k = self.k_norm(self.k_proj(both).reshape(len(both), self.kv_heads, -1)).swapaxes(0, 1)
        v = self.v_proj(both).reshape(len(both), self.kv_heads, -1).swapaxes(0, 1)
        q, k = rope(q, offset=start + ctx.shape[0]), rope(k, offset=start)
        if past is not None:
            k, v = mx.concatenate([past[0], k], axis=1), mx.concatenate([past[1], v], axis=1)
        attn = mx.fast.scaled_dot_product_attention(  # no mask: the block sees everything
            q[None], k[None], v[None], scale=self.head_dim ** -0.5)[0]
        out = self.o_proj(attn.swapaxes(0, 1).reshape(rows, -1))
        x = x + self._after("attention_conv", out, kernel)
        h, kernel = self._before("mlp_conv", self.post_attention_layernorm(x))
        return x + self._after("mlp_conv", self.mlp(h), kernel), (k, v)

    def _before(self, conv: str, h: mx.array) -> tuple[mx.array, mx.array | None]:
        return self[conv].prepare(h) if conv in self else (h, None)

    def _after(self, conv: str, out: mx.array, kernel: mx.array | None) -> mx.array:
        return self[conv].finish(out, kernel) if conv in self else out


class CandidateSelector(nn.Module):
    """DFlash 2's selector weights: codebooks [V, r] and the hidden projection [r, H]."""

    def __init__(self, vocab: int, hidden: int, shape: DFlash2Config) -> None:
        super().__init__()
        self.shape = shape
        self.predecessor_codebook = mx.zeros((vocab, shape.rank))
        self.successor_codebook = mx.zeros((vocab, shape.rank))
        self.hidden_projection = nn.Linear(hidden, shape.rank, bias=False)


class DFlashModel(nn.Module):
    """The drafter's own layers: feature fusion, draft layers, final norm (and DFlash 2's
    selector, None for DFlash 1)."""

    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        hidden, eps = spec.hidden_size, float(spec.get("rms_norm_eps", 1e-6))
        self.layers = [DFlashLayer(spec) for _ in range(int(spec.get("num_hidden_layers")))]
        self.fc = nn.Linear(len(spec.layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm, self.norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.rope = _rope(spec)
        if spec.version2:
            self.candidate_selector = CandidateSelector(int(spec.get("vocab_size")), hidden,
                                                        spec.version2)

    def __call__(self, features: mx.array, block: mx.array, first_position: int,
                 cache: list[KV]) -> tuple[mx.array, list[KV]]:
        """features [C, n*H] of the context rows not yet cached, block [B, H] embeddings;
        positions run from first_position over context then block."""
        ctx = self.hidden_norm(self.fc(features.astype(block.dtype)))
        x, new = block, []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, ctx, self.rope, first_position, cache[i] if cache else None)
            new.append(kv)
        return self.norm(x), new


def load_dflash_drafter(target: Any, path: str) -> BlockDrafter:
    """A z-lab DFlash (1 or 2) drafter folder, checked against the MLX target."""
    embed, final_norm, output = target_parts(target.net, target.name)
    spec = read_spec(path, hidden_size=int(final_norm.weight.shape[-1]),
                     vocab_size=target.vocab_size, n_layers=target.n_layers,
                     head_rows=target.vocab_size)
    if spec.get("hidden_act", "silu") != "silu":
        raise SpecdeckError(f"{spec.folder} uses {spec.get('hidden_act')!r}; the MLX DFlash "
                            "drafter runs silu layers: use --backend torch")
    model = DFlashModel(spec)
    _load_weights(spec, model, target.compute_dtype)
    return BlockDrafter(model, MlxArrays(target.stream), layer_ids=spec.layer_ids,
                        block_size=spec.block_size, mask_token_id=spec.mask_token_id,
                        embed=embed, lm_head=output, embed_scale=spec.embed_scale)


def _load_weights(spec: DFlashSpec, model: DFlashModel, dtype: mx.Dtype) -> None:
    load_checked(spec.weights, model, module_names,
                 lambda missing, extra: check_tensors(spec, missing, extra), spec.folder, dtype)


def load_checked(files: Any, model: nn.Module, rename: Callable[[dict], dict],
                 check: Callable[[set, set], None], folder: Any, dtype: mx.Dtype) -> None:
    """A block drafter's weights from its safetensors into model: the stored names renamed to
    the modules' (rename), missing and unexpected names refused by check, and every shape
    matched, naming the first that differ; then cast to dtype (the target's) and evaluated."""
    stored: dict[str, mx.array] = {}
    for file in files:
        try:
            stored.update(mx.load(str(file)))
        except (OSError, RuntimeError, ValueError) as error:
            raise SpecdeckError(f"cannot read {file}: {error}") from error
    weights, own = rename(stored), dict(tree_flatten(model.parameters()))
    check(set(own) - set(weights), set(weights) - set(own))
    wrong = [f"{name} {tuple(value.shape)} != {tuple(own[name].shape)}"
             for name, value in weights.items() if value.shape != own[name].shape]
    if wrong:
        raise SpecdeckError(f"{folder}: its tensors do not match its config: "
                            f"size mismatch {wrong[:3]}")
    model.load_weights(list(weights.items()))
    model.set_dtype(dtype)
    mx.eval(model.parameters())


def _rope(spec: DFlashSpec) -> nn.Module:
    rope = spec.rope
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None if rope_type == "default" else rope
    try:
        return initialize_rope(spec.head_dim, rope["rope_theta"], False, scaling,
                               int(spec.get("max_position_embeddings", 4096)))
    except (KeyError, ValueError) as error:
        raise SpecdeckError(f"{spec.folder} asks for RoPE {rope_type!r}, which this mlx-lm "
                            f"does not run ({error}): use --backend torch") from error
