"""Prompt lookup: draft the tokens that followed the latest earlier copy of the context's suffix.

Knows: token histories only. Must not know: models, probabilities (its drafts are
deterministic, q is one-hot). Matching tries the longest suffix first, from max_n down to
min_n, and takes the most recent earlier occurrence: recent text predicts the continuation
of code edits and quotations better than the first occurrence does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.core.types import Draft, SamplingParams


def propose_lookup(context: Sequence[int], k: int, min_n: int = 1,
                   max_n: int = 4) -> tuple[int, ...]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix."""
    if k <= 0 or len(context) < min_n + 1:
        return ()
    tokens = np.asarray(context, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # windows starting at 0 .. len-n-1: every occurrence except the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return tuple(int(t) for t in tokens[follow:follow + k])
    return ()


class NgramDrafter:
    """Drafter over the prompt and the output so far; no model, no state between steps."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.name = "ngram"

    def begin(self, prompt_ids: Sequence[int], first_output: object,
              params: SamplingParams, rng: np.random.Generator) -> None:
        return None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return Draft(tokens=propose_lookup(context, k, self.min_n, self.max_n))

    def accept(self, n_accepted: int, verified: object) -> None:
        return None


class NoDrafter:
    """Plain decoding: the same engine loop with a drafter that proposes nothing."""

    name = "none"
    capture_layers: tuple[int, ...] = ()

    def begin(self, prompt_ids: Sequence[int], first_output: object,
              params: SamplingParams, rng: np.random.Generator) -> None:
        return None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return Draft()

    def accept(self, n_accepted: int, verified: object) -> None:
        return None
