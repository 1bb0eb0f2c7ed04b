"""Prompt lookup: draft the tokens that followed earlier copies of the context's suffix.

Knows: token histories only. Must not know: models, probabilities (its drafts are
deterministic, q is one-hot). Matching tries the longest suffix first, from max_n down to
min_n, and takes the most recent earlier occurrence: recent text predicts the continuation
of code edits and quotations better than the first occurrence does. The tree variant keeps
every distinct continuation of the matched suffix (SGLang's n-gram tree and suffix decoding
do the same), most recent first, within a node budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from app.core.protocols import NoDrafter, StepFeed  # noqa: F401 - NoDrafter re-exported
from app.core.types import Draft, SamplingParams


def propose_lookup(context: Sequence[int], k: int, min_n: int = 1,
                   max_n: int = 4) -> tuple[int, ...]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix.

    >>> propose_lookup([5, 6, 7, 9, 5, 6], k=2, min_n=1, max_n=3)  # "5 6" was followed by 7 9
    (7, 9)
    """
    tokens, follows = _matches(context, k, min_n, max_n)
    if not follows:
        return ()
    return tuple(int(t) for t in tokens[follows[-1]:follows[-1] + k])


def propose_lookup_tree(context: Sequence[int], k: int, min_n: int = 1, max_n: int = 4,
                        max_nodes: int = 16) -> Draft:
    """Every distinct continuation (up to k deep) of the longest matched suffix, as a tree.

    The most recent continuation comes first among siblings, so the tree's first chain is
    exactly `propose_lookup`'s draft; nodes are added breadth of recency first, continuation
    by continuation, until max_nodes.

    >>> propose_lookup_tree([1, 2, 3, 1, 2, 4, 1, 2], k=2).tokens  # "1 2" -> 4 1, and 3 1
    (4, 1, 3, 1)
    """
    tokens, follows = _matches(context, k, min_n, max_n)
    nodes: dict[tuple[int, ...], int] = {}  # token path from the root -> node index
    out, parents = [], []
    for start in reversed(follows):
        path: tuple[int, ...] = ()
        for token in (int(t) for t in tokens[start:start + k]):
            path = (*path, token)
            if path in nodes:
                continue
            if len(out) == max_nodes:
                return Draft(tokens=tuple(out), parents=tuple(parents))
            nodes[path] = len(out)
            parents.append(nodes.get(path[:-1], -1))
            out.append(token)
    return Draft(tokens=tuple(out), parents=tuple(parents))


def _matches(context: Sequence[int], k: int, min_n: int, max_n: int
             ) -> tuple[np.ndarray, list[int]]:
    """The context as an array and where each earlier match of its longest suffix is followed
    (oldest first); no matches when none of length min_n..max_n exists."""
    tokens = np.asarray(context, dtype=np.int64)
    if k <= 0 or len(tokens) < min_n + 1:
        return tokens, []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # windows starting at 0 .. len-n-1: every occurrence except the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            return tokens, [int(s) + n for s in starts]
    return tokens, []


class NgramDrafter:
    """Drafter over the prompt and the output so far; no model, no state between steps.

    full_only: draft only where k tokens follow the match (as the first member of a chain,
    a short lookup would otherwise pre-empt the model for a draft shorter than it makes).
    tree: propose every continuation of the match, within max_nodes.
    """

    capture_layers: tuple[int, ...] = ()

    def __init__(self, min_n: int = 1, max_n: int = 4, full_only: bool = False,
                 tree: bool = False, max_nodes: int = 16, name: str = "") -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.full_only, self.tree, self.max_nodes = full_only, tree, max_nodes
        self.name = name or ("ngram-tree" if tree else "ngram")

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: np.random.Generator) -> None:
        return None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self.tree:
            draft = propose_lookup_tree(context, k, self.min_n, self.max_n, self.max_nodes)
            return replace(draft, source=self.name)
        tokens = propose_lookup(context, k, self.min_n, self.max_n)
        if self.full_only and len(tokens) < k:
            return Draft()
        return Draft(tokens=tokens, source=self.name)

    def accept(self, feed: StepFeed) -> None:
        return None
