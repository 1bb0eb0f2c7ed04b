"""DFlash block drafters on torch (z-lab, arXiv 2602.06036): the weight modules, and the
block drafter (backends/heads/dflash_drafter.py) built on them from a folder.

Knows: the drafter's layers as torch modules (HEADS.md §3.2: the target features of committed
rows, fused by `hidden_norm(fc(cat(...)))`, enter every draft layer only as keys and values
through the same k/v projections as the block; the block attends to them, to its cache and to
itself without a causal mask), transformers' Qwen3 pieces they reuse, torch's safetensors
loading. Must not know: the folder's format (backends/heads/dflash_format.py), drafting (the
block, the cache's crop, the choice of drafts: backends/heads/dflash_drafter.py), surfaces,
the engine's loop.

A DFlash 2 folder (`DFlash2DraftModel`) adds convolutions around each sublayer and a candidate
selector's weights (dflash2.py); the layers, the cache and the block are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from backends.heads.dflash_drafter import BlockDrafter
from backends.heads.dflash_format import (
    DFlashSpec,
    check_tensors,
    default_layer_ids,
    module_names,
    read_spec,
)
from backends.torch.arrays import TorchArrays
from backends.torch.head_weights.dflash2 import CandidateSelector, GroupedCausalConv, add_dflash2

__all__ = ["DFlashDrafter", "DFlashLayer", "DFlashModel", "default_layer_ids",
           "load_dflash_drafter"]


class DFlashLayer(torch.nn.Module):
    """A Qwen3 decoder layer whose keys and values also cover the injected context."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        hidden, heads, kv = config.hidden_size, config.num_attention_heads, \
            config.num_key_value_heads
        self.head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.heads, self.kv_heads = heads, kv
        self.q_proj = torch.nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(hidden, kv * self.head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(hidden, kv * self.head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.attention_conv: GroupedCausalConv | None = None  # DFlash 2 sets both
        self.mlp_conv: GroupedCausalConv | None = None

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, H] block rows, ctx [C, H] new context rows; cos/sin over C + B positions.
        Returns the block's output and the keys/values of past + context + block."""
        rows = x.shape[0]
        h, kernel = _before(self.attention_conv, self.input_layernorm(x))
        q = self.q_norm(self.q_proj(h).view(rows, self.heads, self.head_dim)).transpose(0, 1)
        both = torch.cat([ctx, h])
        k = self.k_norm(self.k_proj(both).view(len(both), self.kv_heads, self.head_dim))
        v = self.v_proj(both).view(len(both), self.kv_heads, self.head_dim).transpose(0, 1)
        k = k.transpose(0, 1)
        q = q * cos[-rows:] + rotate_half(q) * sin[-rows:]
        k = k * cos + rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        group = self.heads // self.kv_heads
        attn = F.scaled_dot_product_attention(  # no mask: the block sees everything
            q[None], k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None],
            scale=self.head_dim ** -0.5)[0]
        x = x + _after(self.attention_conv, self.o_proj(attn.transpose(0, 1).reshape(rows, -1)),
                       kernel)
        h, kernel = _before(self.mlp_conv, self.post_attention_layernorm(x))
        return x + _after(self.mlp_conv, self.mlp(h), kernel), (k, v)


def _before(conv: GroupedCausalConv | None, h: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (h, None) if conv is None else conv.prepare(h)


def _after(conv: GroupedCausalConv | None, out: torch.Tensor,
           kernel: torch.Tensor | None) -> torch.Tensor:
    return out if conv is None else conv.finish(out, kernel)


class DFlashModel(torch.nn.Module):
    """The drafter's own layers: feature fusion, draft layers, final norm."""

    def __init__(self, config: Qwen3Config, n_features: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(DFlashLayer(config)
                                          for _ in range(config.num_hidden_layers))
        self.fc = torch.nn.Linear(n_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)
        self.candidate_selector: CandidateSelector | None = None  # DFlash 2 sets it

    def forward(self, features: torch.Tensor, block: torch.Tensor, first_position: int,
                cache: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """features [C, n*H] of the context rows not yet cached, block [B, H] embeddings;
        positions run from first_position over context then block."""
        ctx = self.hidden_norm(self.fc(features.to(block.dtype)))
        positions = torch.arange(first_position, first_position + len(ctx) + len(block),
                                 device=block.device)[None]
        cos, sin = (t[0] for t in self.rotary(block[None], positions))  # [P, d], per head
        x, new = block, []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, ctx, cos, sin, cache[i] if cache else None)
            new.append(kv)
        return self.norm(x), new


class DFlashDrafter(BlockDrafter):
    """The block drafter (backends/heads/dflash_drafter.py) on a torch target."""

    def __init__(self, target: Any, model: DFlashModel, layer_ids: Sequence[int],
                 block_size: int, mask_token_id: int, embed_scale: float = 1.0) -> None:
        embed = target.hf.get_input_embeddings()
        super().__init__(model, TorchArrays(embed.weight.device), layer_ids=layer_ids,
                         block_size=block_size, mask_token_id=mask_token_id, embed=embed,
                         lm_head=target.hf.get_output_embeddings(), embed_scale=embed_scale)
        self.target = target


# ---- loading -------------------------------------------------------------------------------


def load_dflash_drafter(target: Any, path: str) -> DFlashDrafter:
    """A z-lab DFlash (1 or 2) drafter folder, checked against the target."""
    spec = read_spec(path, hidden_size=int(target.hf.config.get_text_config().hidden_size),
                     vocab_size=target.vocab_size, n_layers=target.n_layers,
                     head_rows=int(target.hf.get_output_embeddings().weight.shape[0]))
    config = Qwen3Config(**spec.config)
    model = DFlashModel(config, len(spec.layer_ids))
    if spec.version2:
        add_dflash2(model, config.vocab_size, config.hidden_size, spec.version2)
    _load_weights(spec, model)
    model = model.to(device=target.device, dtype=target.hf.dtype).eval()
    return DFlashDrafter(target, model, spec.layer_ids, spec.block_size, spec.mask_token_id,
                         spec.embed_scale)


def _load_weights(spec: DFlashSpec, model: DFlashModel) -> None:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in spec.weights:
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(module_names(state), strict=False)
    check_tensors(spec, [m for m in missing if not m.startswith("rotary.")], unexpected)
