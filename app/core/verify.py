"""Verification: a draft and the target's rows -> Verdict. Pure functions.

Knows: greedy matching and Leviathan/Chen rejection sampling with recovered and bonus
tokens; a deterministic drafter (no probs) is a one-hot q. Must not know: models, caches,
how the rows were computed. Row i of the target scores draft token i; row k is the bonus row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.core.sampling import sample
from app.core.types import Draft, Verdict


def verify_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> Verdict:
    """Accept while each draft token equals the target's argmax; then emit the argmax."""
    n = 0
    for drafted, best in zip(draft_tokens, target_argmax):
        if drafted != best:
            return Verdict(n_accepted=n, next_token=int(best), is_bonus=False)
        n += 1
    return Verdict(n_accepted=n, next_token=int(target_argmax[n]), is_bonus=True)


def verify_sampled(draft: Draft, target_probs: np.ndarray, rng: np.random.Generator) -> Verdict:
    """Rejection sampling: accept d_i with min(1, p_i(d_i) / q_i(d_i)).

    target_probs: [len(draft.tokens) + 1, vocab], already warped by app.core.sampling.warp.
    On the first rejection the recovered token is drawn from normalise(max(p - q, 0)); when
    every draft survives the bonus token is drawn from the last row.
    """
    vocab = target_probs.shape[-1]
    for i, token in enumerate(draft.tokens):
        p = target_probs[i]
        q = _draft_row(draft, i, vocab)
        if q[token] > 0 and rng.random() * q[token] < p[token]:
            continue
        residual = np.maximum(p - q, 0.0)
        # the residual can only vanish through rounding; p itself is then the exact fallback
        row = residual if residual.sum() > 0 else p
        return Verdict(n_accepted=i, next_token=sample(row, rng), is_bonus=False)
    n = len(draft.tokens)
    return Verdict(n_accepted=n, next_token=sample(target_probs[n], rng), is_bonus=True)


def _draft_row(draft: Draft, i: int, vocab: int) -> np.ndarray:
    """q_i over the target's vocabulary: one-hot for deterministic drafts, padded or cut to size."""
    if draft.probs is None:
        row = np.zeros(vocab)
        row[draft.tokens[i]] = 1.0
        return row
    q = np.asarray(draft.probs[i], dtype=np.float64)
    if len(q) >= vocab:
        return q[:vocab]
    return np.concatenate([q, np.zeros(vocab - len(q))])
