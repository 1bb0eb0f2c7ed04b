"""EAGLE heads as torch modules: EAGLE-3 (`Eagle3Head`) and EAGLE-1/2 (`Eagle1Head`), built
by backends/heads/eagle_net.py on torch's layers, with their loader (`load_eagle_head`) and the
EAGLE-3 writer (`save_eagle3`).

Knows: torch's side of the heads' kit (../shared/docs/HEADS.md 1.2: RMSNorm in fp32, the
head's own RoPE through transformers' rope functions, fused attention with grouped heads),
safetensors I/O. Must not know: the networks' structure (eagle_net), drafting policy
(backends/heads/eagle_drafter.py), head folders (backends/heads/eagle_format.py), the target
beyond the sizes it is checked against.

API: backends/heads/eagle_net.py's; positions [B, T] may hold a batch (training), mask bool
[T, past + T] is shared by the batch. Train-head builds on `Eagle3Head(spec)` (its `d2t`,
`t2d` buffers, `midlayer.*`) and `save_eagle3(head, folder)`, which writes the authors' layout
(`midlayer.*`, config.json) that vLLM and SGLang load.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.activations import ACT2FN

from app.core.types import SpecdeckError
from backends.heads.eagle_format import (
    EagleSpec,
    check_tensor_names,
    check_vocab_map,
    checked_spec,
    eagle3_config,
    head_tensors,
)
from backends.heads.eagle_net import eagle_modules


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rope(nn.Module):
    """The head's own rotary embedding (its rope_parameters, not the target's)."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        rope_type = spec.rope.get("rope_type", "default")
        self.scale = 1.0
        if rope_type == "default":
            dims = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float()
            inv_freq = 1.0 / (spec.rope["rope_theta"] ** (dims / spec.head_dim))
        else:
            inv_freq, self.scale = _scaled_inv_freq(spec)
        # an attribute, not a buffer: module.to(bfloat16) must not round the frequencies
        self.inv_freq = inv_freq.float()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, head_dim] for positions [B, T]."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def _scaled_inv_freq(spec: EagleSpec) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = spec.rope["rope_type"]
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise SpecdeckError(f"{spec.name} asks for RoPE type {rope_type!r}, which this "
                            f"transformers does not know: upgrade transformers")
    config = LlamaConfig(hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
                         head_dim=spec.head_dim, rope_parameters=dict(spec.rope),
                         max_position_embeddings=spec.max_position_embeddings)
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq, float(scale)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _allowed(mask: torch.Tensor | None, rows: int, keys: int, device: Any) -> torch.Tensor:
    """The bool mask [rows, keys] a row attends through (causal after the past, when None)."""
    if mask is not None:
        return mask
    allowed = torch.ones(rows, keys, dtype=torch.bool, device=device)
    allowed[:, keys - rows:] = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    return allowed


class TorchKit:
    """backends/heads/eagle_net.Kit on torch.nn."""

    Module, linear, embedding, rms_norm = nn.Module, nn.Linear, nn.Embedding, RMSNorm

    def modules(self, items: list[nn.Module]) -> nn.ModuleList:
        return nn.ModuleList(items)

    def activation(self, name: str, spec: EagleSpec) -> nn.Module:
        return ACT2FN[name]

    def rope(self, spec: EagleSpec) -> Rope:
        return Rope(spec)

    def rotate(self, x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]
               ) -> torch.Tensor:
        cos, sin = rotation
        return x * cos + _rotate_half(x) * sin

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        # torch's fused attention accumulates in fp32 whatever the inputs: the head reading a
        # 700-token prompt took 472 ms in bf16 matmuls on a CPU without native bf16, 16 here
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
            attn_mask=_allowed(mask, q.shape[2], k.shape[2], q.device))

    def concat(self, parts: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.cat(list(parts), dim=axis)

    def buffer(self, module: nn.Module, name: str, values: np.ndarray) -> None:
        module.register_buffer(name, torch.from_numpy(values))


_MODULES = eagle_modules(TorchKit())
Eagle3Head = _MODULES.Eagle3Head
Eagle1Head = _MODULES.Eagle1Head


def load_eagle_head(path: str | Path, *, kind: str, target_name: str, hidden_size: int,
                    vocab_size: int, n_layers: int, dtype: torch.dtype = torch.float32,
                    device: str = "cpu") -> tuple[nn.Module, EagleSpec]:
    """A head folder in any published layout as (module, spec), refused when it is not `kind`
    ("eagle3" or "eagle") or was built for another target (both named)."""
    spec = checked_spec(path, kind=kind, target_name=target_name, hidden_size=hidden_size,
                        vocab_size=vocab_size, n_layers=n_layers)
    head: nn.Module = Eagle3Head(spec) if kind == "eagle3" else Eagle1Head(spec)
    state = head_tensors(load_file(spec.weights), spec)
    check_tensor_names(spec, set(head.state_dict()), set(state))
    head.load_state_dict(state, strict=False)
    if kind == "eagle3":
        ids = head.to_target(torch.arange(spec.draft_vocab_size))
        check_vocab_map(spec, int(ids.min()), int(ids.max()), int(head.t2d.sum()))
    return head.to(device=device, dtype=dtype).eval(), spec


def save_eagle3(head: Eagle3Head, folder: str | Path) -> Path:
    """Write the head in the authors' layout: config.json + model.safetensors (midlayer.*)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if head.spec.draft_vocab_size == head.spec.vocab_size:
        state.pop("d2t"), state.pop("t2d")  # identity maps are left out, as the authors do
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(eagle3_config(head.spec), indent=2))
    return folder
