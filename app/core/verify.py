"""Verification: a draft (chain or tree) and the target's rows -> Verdict. Pure functions.

Knows: greedy matching and rejection sampling with recovered and bonus tokens, over chains and
trees; a deterministic drafter (no probs) is a one-hot q. Must not know: models, caches, how
the rows were computed. Row 0 scores the children of the pending token; row i + 1 scores the
children of node i (and is the bonus row when node i is a leaf).

Trees are verified by recursive rejection sampling (SpecInfer; Jeon et al., "Recursive
Speculative Decoding"): at a node, its children are tried in order, child c accepted with
min(1, p(c) / q_c(c)); after a rejection p becomes normalise(max(p - q_c, 0)) and the next
child is tried against it; when every child was rejected the recovered token is drawn from
what is left of p. q_c is the distribution child c was drawn from given its earlier siblings,
so deterministic, i.i.d. and without-replacement children are all exact. A chain is the
tree with one child per node, which makes this Leviathan/Chen rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.core.sampling import sample
from app.core.types import Draft, Verdict


def children_of(draft: Draft) -> dict[int, list[int]]:
    """node -> its children in draft order; -1 is the pending token."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parent_list()):
        kids.setdefault(p, []).append(i)
    return kids


def verify_greedy(draft: Draft, target_argmax: Sequence[int]) -> Verdict:
    """Follow the child whose token is the target's argmax; emit the argmax where none is."""
    kids = children_of(draft)
    path: list[int] = []
    node = -1
    while True:
        best = int(target_argmax[node + 1])
        match = next((c for c in kids.get(node, ()) if draft.tokens[c] == best), None)
        if match is None:
            return Verdict(path=tuple(path), next_token=best, is_bonus=node not in kids)
        path.append(match)
        node = match


def verify_sampled(draft: Draft, target_probs: np.ndarray, rng: np.random.Generator) -> Verdict:
    """Recursive rejection sampling down the tree; target_probs [rows, vocab] already warped."""
    kids = children_of(draft)
    vocab = target_probs.shape[-1]
    path: list[int] = []
    node = -1
    while node in kids:
        p = target_probs[node + 1]
        for child in kids[node]:
            token = draft.tokens[child]
            q = _draft_row(draft, child, vocab)
            if q[token] > 0 and rng.random() * q[token] < p[token]:
                break
            residual = np.maximum(p - q, 0.0)
            # the residual can only vanish through rounding; p itself is then the exact fallback
            p = residual / residual.sum() if residual.sum() > 0 else p
        else:
            return Verdict(path=tuple(path), next_token=sample(p, rng), is_bonus=False)
        path.append(child)
        node = child
    return Verdict(path=tuple(path), next_token=sample(target_probs[node + 1], rng),
                   is_bonus=True)


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
