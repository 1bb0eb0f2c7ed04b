"""StepFeed: what a drafter reads after a target forward, built once by the engine.

Knows: which rows of a forward the engine kept (the prompt's rows after the prefill; the
pending token's and the accepted drafts' rows after a verify), the tokens the target read at
them, their absolute positions, the next token (bonus or recovered, not yet read by the
target) and the captured hidden states of those rows. The shape follows vLLM's proposer
inputs: target_token_ids, target_positions, target_hidden_states, next_token_ids.
Must not know: an array library (rows are taken by slicing or list indexing, which torch,
mlx and numpy arrays all support), any drafter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from app.core.output import TargetOutput
from app.core.types import Draft, Verdict


@dataclass(frozen=True)
class StepFeed:
    """Row i read tokens[i] at position start + i; next_token sits at `end`, unread.

    rows index the forward's hidden-state rows (every input row), so a prompt feed's rows
    are 0..n-1 and a verify's are 0 (the pending token) and 1 + each accepted node. The feed
    keeps the forward's argmax and captured states, never its logits: a drafter may hold
    feeds for several steps.
    """

    tokens: tuple[int, ...]
    start: int
    rows: tuple[int, ...]
    next_token: int
    argmax: tuple[int, ...] = ()  # every scored row's (lookahead reads the rows not kept)
    captured: Mapping[int, Any] = field(default_factory=dict, repr=False)  # all rows

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.rows) or not self.tokens:
            raise ValueError(f"a feed needs one row per token (tokens {self.tokens}, "
                             f"rows {self.rows})")

    @classmethod
    def prompt(cls, prompt_ids: Sequence[int], first_output: TargetOutput, next_token: int,
               start: int = 0) -> StepFeed:
        """The prefill's feed: prompt tokens from `start` (the cached prefix is not re-read),
        next_token the first output token."""
        tokens = tuple(int(t) for t in prompt_ids[start:])
        return cls(tokens, start, tuple(range(len(tokens))), int(next_token),
                   first_output.argmax, first_output.hidden_states)

    @classmethod
    def verify(cls, pending: int, start: int, draft: Draft, verdict: Verdict,
               verified: TargetOutput) -> StepFeed:
        """A verify's feed: the pending token at `start`, then the accepted path's nodes, each
        at row 1 + its index in the draft (a tree's path skips the rejected siblings)."""
        tokens = (int(pending), *(draft.tokens[i] for i in verdict.path))
        rows = (0, *(i + 1 for i in verdict.path))
        return cls(tokens, start, rows, verdict.next_token, verified.argmax,
                   verified.hidden_states)

    @property
    def end(self) -> int:
        """The next token's position: one past the last row."""
        return self.start + len(self.tokens)

    @property
    def positions(self) -> range:
        return range(self.start, self.end)

    @property
    def following(self) -> tuple[int, ...]:
        """Per row, the token after it (what a head pairs with that row's state)."""
        return (*self.tokens[1:], self.next_token)

    @cached_property
    def hidden_states(self) -> Mapping[int, Any]:
        """Captured layer -> backend array [rows, hidden] of the kept rows, taken on first
        read: drafters without heads never pay for it."""
        return {layer: _take(states, self.rows) for layer, states in self.captured.items()}

    def since(self, position: int) -> StepFeed:
        """The rows at `position` and after (a drafter already holding the earlier ones)."""
        skip = max(position - self.start, 0)
        if skip == 0:
            return self
        return StepFeed(self.tokens[skip:], self.start + skip, self.rows[skip:],
                        self.next_token, self.argmax, self.captured)


def _take(states: Any, rows: tuple[int, ...]) -> Any:
    # a chain keeps a run of rows: a slice is a view, no copy; a tree path needs a list
    # (a tuple would index several dimensions)
    if rows == tuple(range(rows[0], rows[0] + len(rows))):
        return states[rows[0]:rows[0] + len(rows)]
    return states[list(rows)]
