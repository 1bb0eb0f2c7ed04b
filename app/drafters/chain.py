"""ChainDrafter: drafters tried in order; the first that proposes anything drafts the step.

Knows: the Drafter protocol. Must not know: what its members are. llama.cpp chains its
speculative implementations the same way; here every draft carries the proposing member's
name (Draft.source), so statistics and the k controller's draft cost stay per member.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from app.core.drafting import Proposal, alone, proposal
from app.core.protocols import Drafter, StepFeed
from app.core.types import Draft, SamplingParams


class ChainDrafter:
    """Members in order of preference: cheap ones (lookup) first, a model last."""

    def __init__(self, members: Sequence[Drafter], name: str = "chain") -> None:
        if not members:
            raise ValueError("a chain needs at least one member")
        self.members = tuple(members)
        self.name = name
        self.capture_layers = tuple(sorted({i for m in self.members for i in m.capture_layers}))

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: np.random.Generator) -> None:
        for member in self.members:
            member.begin(prompt_ids, feed, params, rng)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return alone(self.propose_steps(context, k))

    def propose_steps(self, context: Sequence[int], k: int) -> Proposal:
        """propose, a member's forwards yielded (app/core/drafting.py)."""
        for member in self.members:
            draft = yield from proposal(member, context, k)
            if draft.tokens:
                return draft if draft.source else replace(draft, source=member.name)
        return Draft()

    def accept(self, feed: StepFeed) -> None:
        # every member hears every outcome: one that did not draft still tracks the text
        for member in self.members:
            member.accept(feed)
