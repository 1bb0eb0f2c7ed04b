"""HeadRows: the bookkeeping an EAGLE head drafter keeps so its KV cache follows the accepted
path (backends/heads/eagle_drafter.py, on either backend).

Knows: the Drafter protocol's begin/accept calls and their StepFeed (the engine's kept rows,
their positions and the token after each), and the alignment of HEADS.md 1.2-1.3 (the head
row at position t reads the target's state at t and the embedding of token t + 1). Must not
know: an array library (`arrays`, backends/arrays, joins the states), the head's modules,
drafting.

State: committed head rows (`_rows`, their positions; `_past`, the head's KV per layer as
[batch, heads, rows, dim] pairs), the feeds that arrived since the last propose (`_pending`),
the context the rows were built from (`_ctx`) and the head's output at the last row (`_root`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from app.core.protocols import StepFeed
from app.core.types import SamplingParams, common_prefix_length

# a chain stops drafting once the head's own probability that all its drafts are right falls
# below this (HeadRows.confident)
CHAIN_MIN_CONFIDENCE = 0.2


class HeadRows:
    """Where the head's rows stand; a subclass sets `arrays` (backends/arrays.Arrays)."""

    arrays: Any
    capture_layers: tuple[int, ...] = ()
    min_confidence = 0.0

    def confident(self, reach: float) -> bool:
        """Whether a chain drafts one more token: `reach` is the head's own probability that
        every draft so far is right (the product of its probabilities of the tokens it chose).
        Stopping on the draft's own numbers, never the target's, keeps verification lossless;
        a head right 44% of the time at depth 1 and 11% at depth 3 was drafting to k = 7."""
        return reach >= self.min_confidence

    def _reset(self) -> None:
        self._past: list[tuple[Any, Any]] | None = None  # committed head rows' KV
        self._rows: list[int] = []  # position of each committed row
        self._ctx: list[int] = []  # tokens of the context the rows were built from
        self._pending: list[StepFeed] = []  # feeds whose target states are not yet read
        self._next = 0  # position of the token after the last fed row: the pending token's
        self._root: tuple[Any, Any] | None = None  # logits, feedback

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: np.random.Generator) -> None:
        self._params, self._rng = params, rng
        prompt = [int(t) for t in prompt_ids]
        # a committed row t read tokens up to t + 1: it stays while those match the prompt
        self._truncate(common_prefix_length(self._ctx, prompt) - 2)
        self._pending = [feed.since(self._rows[-1] + 1 if self._rows else 0)]
        self._next = feed.end
        self._ctx, self._root = prompt, None

    def accept(self, feed: StepFeed) -> None:
        self._pending.append(feed)
        self._next = feed.end

    def _can_draft(self, context: Sequence[int]) -> bool:
        """Whether the states for this context arrived (no begin: nothing to draft from)."""
        return self._next == len(context) - 1

    def _take_pending(self) -> tuple[dict[int, Any], list[int], int] | None:
        """The pending states joined per layer, the token after each row and the first row's
        position; they are then no longer pending."""
        if not self._pending:
            return None
        feeds, self._pending = self._pending, []
        layers = {i: self.arrays.concat([f.hidden_states[i] for f in feeds])
                  for i in self.capture_layers}
        return layers, [t for f in feeds for t in f.following], feeds[0].start

    def _commit(self, context: list[int], start: int, end: int, past: list[tuple[Any, Any]],
                root: tuple[Any, Any]) -> None:
        """Rows start..end-1 are now in the head's cache, built from context."""
        self._past, self._root, self._ctx = past, root, context
        self._rows.extend(range(start, end))

    def _truncate(self, last_position: int) -> None:
        keep = sum(1 for p in self._rows if p <= last_position)
        self._rows = self._rows[:keep]
        if self._past is not None:
            self._past = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self._past]
