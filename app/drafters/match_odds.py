"""MatchOdds: how often a suffix match's next token was right, by how long the match was.

Knows: decayed counts per match-length bucket (1, 2-3, 4-7, ..., 64 and more) of draft
tokens held against the text that followed, each beside its count-based probability
(SuffixDecoding's: how often the token followed the match), and from them the calibrated
survival of a chain: the estimate that a node and every node before it are accepted. A node
j deep in a match of length L continues a match of L + j tokens, so a long repeat earns a long
draft while a template's short matches (a tool call's keys before new arguments) earn short
ones. Must not know: indexes, the target, the k controller (it reads only the survival).

Why held against the text and not against verify outcomes: under greedy decoding a one-hot
draft token is accepted exactly when it is the token that follows, and under sampling with
the probability that the target then emits it, so the text alone judges every prediction,
including those of steps another member drafted or that ran plain: no exploration is needed
to learn how deep a draft would have paid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

BUCKETS = 7  # match lengths 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64 and more
PRIOR = 0.6  # as the k controller's prior acceptance
PRIOR_WEIGHT = 2.0  # pseudo-tokens of belief in it
DECAY = 0.99  # per token judged in a bucket: about a hundred tokens of memory each


def bucket(length: int) -> int:
    return min(max(length, 1).bit_length() - 1, BUCKETS - 1)


@dataclass
class MatchOdds:
    """Per bucket: tokens right, and the probability the counts had given them."""

    right: list[float] = field(default_factory=lambda: [0.0] * BUCKETS)
    expected: list[float] = field(default_factory=lambda: [0.0] * BUCKETS)

    def scale(self, length: int) -> float:
        """How far the counts' probability is to be trusted at this match length."""
        b = bucket(length)
        return (self.right[b] + PRIOR_WEIGHT * PRIOR) / (self.expected[b] + PRIOR_WEIGHT)

    def survival(self, length: int, probs: Sequence[float]) -> tuple[float, ...]:
        """probs[j]: the counts' probability of node j given the nodes before it."""
        out, alive = [], 1.0
        for j, p in enumerate(probs):
            alive *= min(1.0, self.scale(length + j) * p)
            out.append(alive)
        return tuple(out)

    def judge(self, length: int, probs: Sequence[float], n_right: int, missed: bool) -> None:
        """A chain's first n_right tokens were right; the next one was wrong if missed."""
        for j in range(min(n_right + missed, len(probs))):
            b = bucket(length + j)
            self.right[b] = self.right[b] * DECAY + (j < n_right)
            self.expected[b] = self.expected[b] * DECAY + probs[j]


@dataclass(frozen=True)
class Prediction:
    """A chain drafted at `position` from a match of `length`, waiting for the text."""

    position: int
    tokens: tuple[int, ...]
    length: int
    probs: tuple[float, ...]

    def settle(self, context: Sequence[int], odds: MatchOdds, final: bool) -> bool:
        """Judge the tokens the context now holds; True once judged (the prediction is done).
        final: judge what can be judged now, the rest is dropped."""
        seen = context[self.position:self.position + len(self.tokens)]
        n_right = next((i for i, (a, b) in enumerate(zip(seen, self.tokens)) if a != b),
                       len(seen))
        missed = n_right < len(seen)
        if not (missed or n_right == len(self.tokens) or final):
            return False
        odds.judge(self.length, self.probs, n_right, missed)
        return True
