"""Row-invariant attention for CPU decoding: a token's attention gives the same bits whether it
is computed alone (plain decoding) or among the rows of a verify forward.

Knows: transformers' attention and mask interfaces, PyTorch SDPA on CPU. Must not know:
caches, drafting, which model is loaded.

Why: PyTorch's CPU SDPA picks its blocking from the number of query rows and keys, so one
row's output changed with the rows beside it (measured with random bf16 tensors: for 1-19 rows
after 30-600 keys, most shapes differed from the same rows computed inside a 20-row call).
Here each row is its own SDPA call over exactly the keys it may see, its query heads packed
per KV head, so the call's shape depends only on the row's position. That also skipped the KV
repeat: 28 layers of a 1-row forward over 1000 keys took 4.9 ms against 59 ms batched.
Attention sinks (gpt-oss's `s_aux`, one logit per head in the softmax that reads no value)
are computed here too, row-wise, and for longer forwards too (transformers' SDPA path has
none: gpt-oss declares no SDPA support).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "specdeck_rowwise"
# larger forwards are prompt prefills, computed alike in every mode; a verify of k = 32 draft
# tokens (the engine's limit) or a tree of up to 63 nodes stays row-wise
MAX_ROWWISE_ROWS = 64


def rowwise_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                 scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention one query row at a time over the keys it may see; returns [batch, rows,
    heads, head_dim]. A chain row sees a contiguous window; a tree row (a custom mask) sees the
    prefix and its ancestors, gathered in key order: the keys its chain twin would see."""
    batch, heads, rows, dim = query.shape
    sinks = kwargs.pop("s_aux", None)
    if sinks is not None and (rows > MAX_ROWWISE_ROWS or batch != 1):
        groups = heads // key.shape[1]
        out = _sink_attention(query, key.repeat_interleave(groups, dim=1),
                              value.repeat_interleave(groups, dim=1),
                              _allowed(attention_mask, rows, key.shape[2]), scaling,
                              sinks.reshape(1, heads, 1))
        return out.transpose(1, 2).contiguous(), None
    if rows > MAX_ROWWISE_ROWS or batch != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, **kwargs)
    kv_heads = key.shape[1]
    packed = query.reshape(batch, kv_heads, heads // kv_heads, rows, dim)
    outs = []
    for row, keys in enumerate(_row_keys(attention_mask, rows, key.shape[2])):
        q, k, v = packed[:, :, :, row], key[:, :, keys], value[:, :, keys]
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=scaling) if sinks is None
                    else _sink_attention(q, k, v, None, scaling, sinks.reshape(kv_heads, -1)))
    out = torch.stack(outs, dim=3).reshape(batch, heads, rows, dim)
    return out.transpose(1, 2).contiguous(), None


def _row_keys(mask: torch.Tensor | None, rows: int, keys: int) -> list[slice | torch.Tensor]:
    """The keys each row may see: a slice where they are contiguous (causal, or a sliding
    window), else their indices. The rows are the last `rows` keys."""
    ends = [keys - rows + row + 1 for row in range(rows)]
    if mask is None:
        return [slice(0, end) for end in ends]
    allowed = _allowed(mask, rows, keys)
    starts = allowed.int().argmax(dim=-1).tolist()
    counts = allowed.sum(dim=-1).tolist()
    return [slice(start, end) if count == end - start else allowed[row].nonzero().squeeze(-1)
            for row, (start, end, count) in enumerate(zip(starts, ends, counts))]


def _sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    allowed: torch.Tensor | None, scaling: float | None,
                    sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax also weighs one learned logit per head that reads no value
    (gpt-oss's sinks). query [..., q, dim] against key and value [..., keys, dim] with the
    same leading axes; sinks broadcast against the scores' leading axes and q."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = query @ key.transpose(-1, -2) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).unsqueeze(-1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)
    return probs[..., :-1].to(value.dtype) @ value


def _allowed(mask: torch.Tensor | None, rows: int, keys: int) -> torch.Tensor:
    """The [rows, keys] keys each row may see (the last `rows` keys are the rows)."""
    if mask is None:
        return torch.arange(keys)[None, :] <= torch.arange(keys - rows, keys)[:, None]
    return mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0  # additive: 0 = seen


def register() -> str:
    """Make NAME usable as an attn_implementation (idempotent); returns it."""
    AttentionInterface.register(NAME, rowwise_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
