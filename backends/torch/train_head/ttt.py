"""The EAGLE-3 training objective with training-time test (TTT), over a batch of captured rows.

Knows: how one EAGLE-3 decoder step reads (embedding of the next token, fused hidden state),
how TTT feeds the head its own output for `depth` steps, and the loss the EAGLE-3 authors
train with (SafeAILab/EAGLE `eagle/traineagle3/cnets.py Model.forward`, read at cb7e0841):
step j's row t attends to step 0's keys at positions <= t plus its own keys of steps 1..j at
position t; its target is the target model's distribution restricted to the draft vocabulary;
a row counts only where the target's next token is in the draft vocabulary; step losses are
weighted 0.8**j. Must not know: where rows come from, optimizers, files.

Alignment (HEADS.md 1.2): row t pairs the fused hidden state of position t with the embedding
of token t+1 and predicts token t+2; TTT step j feeds token t+1+j (the data's own token) and
the head's pre-norm output of step j-1, at position t+j, and predicts token t+2+j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

STEP_WEIGHT = 0.8  # ref main.py: ploss_weight = [0.8 ** i ...]


@dataclass(frozen=True)
class Batch:
    """Right-padded rows: tokens [B, T], aux [B, T, 3Ht] (the three captured states), target
    logits over the draft vocabulary [B, T, Vd] (from the target's final state at each
    position), and `counts` [B, T]: token t is a generated token inside the draft vocabulary."""

    tokens: torch.Tensor
    aux: torch.Tensor
    target_logits: torch.Tensor
    counts: torch.Tensor


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor            # weighted sum over depths (what is minimized)
    losses: tuple[float, ...]     # per depth
    correct: tuple[int, ...]      # per depth: rows whose top-1 equals the target's
    rows: tuple[int, ...]         # per depth: rows that counted


def ttt_step(head: torch.nn.Module, embed: torch.nn.Embedding, batch: Batch,
             depth: int) -> StepResult:
    """Loss and top-1 counts of `head` over `depth` TTT steps on one batch."""
    tokens, n_rows = batch.tokens, batch.tokens.shape[1]
    hidden = head.fc(batch.aux.to(head.fc.weight.dtype))
    positions = torch.arange(n_rows, device=tokens.device)
    causal = torch.ones(n_rows, n_rows, dtype=torch.bool, device=tokens.device).tril()
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    loss = hidden.new_zeros((), dtype=torch.float32)
    losses, correct, rows = [], [], []
    for j in range(depth):
        fed = _shift(tokens, 1 + j)                      # token t+1+j at row t
        emb = embed(fed).to(hidden.dtype)
        hidden = _layer(head, emb, hidden, positions + j, causal, keys)
        logits = head.lm_head(head.norm(hidden)).float()
        target = _shift(batch.target_logits, 1 + j).float()   # distribution of token t+2+j
        mask = _shift(batch.counts, 2 + j)
        step_loss, hits, n = _objective(logits, target, mask)
        loss = loss + STEP_WEIGHT ** j * step_loss
        losses.append(float(step_loss.detach()))
        correct.append(hits)
        rows.append(n)
    return StepResult(loss, tuple(losses), tuple(correct), tuple(rows))


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x moved `by` rows to the left along dim 1, zero-filled (ref `padding(left=False)`)."""
    out = torch.zeros_like(x)
    if by < x.shape[1]:
        out[:, :x.shape[1] - by] = x[:, by:]
    return out


def _objective(logits: torch.Tensor, target: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    weights = mask.float()
    n = int(weights.sum())
    log_p = F.log_softmax(logits, dim=-1)
    p_target = F.softmax(target, dim=-1)
    per_row = -(p_target * log_p).sum(-1)
    loss = (per_row * weights).sum() / max(n, 1)
    hits = int(((logits.argmax(-1) == target.argmax(-1)) & mask.bool()).sum())
    return loss, hits, n


def _layer(head: torch.nn.Module, emb: torch.Tensor, hidden: torch.Tensor,
           positions: torch.Tensor, causal: torch.Tensor,
           keys: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One EAGLE-3 decoder layer over every row, appending this step's keys and values."""
    layer = head.midlayer
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
    attn = layer.self_attn
    q, k, v = _heads(attn.q_proj(x), attn.n_heads), _heads(attn.k_proj(x), attn.n_kv), \
        _heads(attn.v_proj(x), attn.n_kv)
    cos, sin = rope(positions, attn.head_dim, attn.rope_theta, q.dtype)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    groups = attn.n_heads // attn.n_kv
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    keys.append((k, v))
    out = _ttt_attention(q, keys, causal)
    b, _, t, _ = out.shape
    h = hidden + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _ttt_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]],
                   causal: torch.Tensor) -> torch.Tensor:
    """Row t of the last step sees step 0's keys at positions <= t and its own earlier steps'
    keys at t (the draft KV cache a chain builds at inference)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = keys[0]
    scores = [(q @ k0.transpose(-1, -2)).float().mul(scale).masked_fill(~causal, float("-inf"))]
    scores += [(q * k).sum(-1, keepdim=True).float().mul(scale) for k, _ in keys[1:]]
    weights = torch.cat(scores, dim=-1).softmax(-1).to(q.dtype)
    n = k0.shape[-2]
    out = weights[..., :n] @ v0
    for i, (_, v) in enumerate(keys[1:]):
        out = out + weights[..., n + i:n + i + 1] * v
    return out


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, n, -1).transpose(1, 2)  # [B, heads, T, head_dim]


def rope(positions: torch.Tensor, head_dim: int, theta: float,
         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) rotary tables for these positions: [T, head_dim] cos and sin."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
