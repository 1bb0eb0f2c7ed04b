"""A fresh EAGLE-3 head for a target, built on the one EAGLE-3 module (backends/torch/head_weights).

Knows: how a target's config sizes a head (its layer mirrors one decoder layer of the target;
no own `embed_tokens`: the target's table is shared, as in the authors' 8B heads; the head's
RoPE takes the target's theta), the draft vocabulary's d2t/t2d, and the start from the
target's output rows. Must not know: training, data, files.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backends.heads.eagle_format import new_eagle3_spec
from backends.torch.head_weights.eagle import Eagle3Head


def new_head(config: Any, draft_ids: torch.Tensor, name: str = "trained") -> Eagle3Head:
    """An EAGLE-3 head sized for the target `config`, drafting over `draft_ids` (ascending)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    rope = getattr(text, "rope_parameters", None) or {}
    spec = new_eagle3_spec(
        name, target_hidden_size=int(text.hidden_size), vocab_size=int(text.vocab_size),
        draft_vocab_size=len(draft_ids), num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        intermediate_size=int(text.intermediate_size),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)))
    head = Eagle3Head(spec)
    head.apply(_init)
    ids = draft_ids.to(torch.long)
    head.d2t.copy_(ids - torch.arange(len(ids)))  # target id = draft id + d2t
    head.t2d.zero_()
    head.t2d[ids] = True
    return head


def draft_ids(head: Eagle3Head) -> torch.Tensor:
    return head.to_target(torch.arange(len(head.d2t), device=head.d2t.device))


def start_from_target(head: Eagle3Head, lm_head: torch.Tensor, final_norm: torch.Tensor) -> None:
    """Copy the target's output rows of the draft vocabulary and its final norm: the head's
    output then starts in the target's output space, which small data needs."""
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_head[draft_ids(head).to(lm_head.device)])
        head.norm.weight.copy_(final_norm)


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
