"""The trainable EAGLE-3 head: parameters under the published names, sized from the target.

Knows: the tensors of an EAGLE-3 head in the authors' format (HEADS.md 1.1 format A:
`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; no `embed_tokens`, the target's table is
used) and the head config a target implies. Must not know: training, data, files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class HeadShape:
    """The numbers that size a head: its layer mirrors one decoder layer of the target."""

    hidden: int            # H, also the target's hidden size (no own embed_tokens)
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int             # target vocabulary
    draft_vocab: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    n_aux: int = 3

    @classmethod
    def from_target(cls, config: Any, draft_vocab: int) -> HeadShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        rope = getattr(text, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
        return cls(hidden=int(text.hidden_size), intermediate=int(text.intermediate_size),
                   heads=heads, kv_heads=int(getattr(text, "num_key_value_heads", heads)),
                   head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                   vocab=int(text.vocab_size), draft_vocab=draft_vocab,
                   rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
                   rope_theta=float(theta),
                   max_positions=int(getattr(text, "max_position_embeddings", 4096)))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Llama style (HEADS.md 0.3): normalize in fp32, cast back, then scale
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.rope_theta = s.rope_theta
        self.q_proj = nn.Linear(2 * s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)


class MLP(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.rms_norm_eps)   # of the token embedding
        self.hidden_norm = RMSNorm(s.hidden, s.rms_norm_eps)       # of the fused hidden state
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_norm_eps)
        self.mlp = MLP(s)


class Eagle3TrainHead(nn.Module):
    """Parameters of an EAGLE-3 head; `d2t`/`t2d` are buffers (the draft vocabulary)."""

    def __init__(self, shape: HeadShape, draft_ids: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(shape.n_aux * shape.hidden, shape.hidden, bias=False)
        self.midlayer = MidLayer(shape)
        self.norm = RMSNorm(shape.hidden, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden, shape.draft_vocab, bias=False)
        ids = draft_ids.to(torch.long)
        self.register_buffer("d2t", ids - torch.arange(len(ids)))  # target = draft + d2t
        t2d = torch.zeros(shape.vocab, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)
        self.apply(_init)

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def start_from_target(self, lm_head: torch.Tensor, final_norm: torch.Tensor) -> None:
        """Copy the target's output rows of the draft vocabulary and its final norm: the
        head's output then starts in the target's output space, which small data needs."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head[self.draft_ids.to(lm_head.device)])
            self.norm.weight.copy_(final_norm)


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
