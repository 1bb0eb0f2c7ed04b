"""AutoK: k="auto" for one generate call, with a k controller per member of a chain.

Knows: the Drafter protocol, a chain's `members` (cheap lookups first, a model last: see
app/drafters/chain.py), one KController per member, which member drafts a step, and the
context rows a member reads before its next draft (`unread_rows`, where it has them).
Must not know: verification, models, timing (the engine measures and hands the times in).

Why per member: one controller priced a chain's k with its dearest member, so a head that did
not pay (18% acceptance) turned speculation off for the chain, and with it the lookup that
alone ran 1.11x plain (SmolLM2-135M, spec-bench): lookup+eagle3 ran 0.98x. Here a lookup is
first asked for one token, and only when it has a continuation does its own controller choose
k; the model member is asked only when no lookup drafted, by its controller. A lookup step
so scans the context twice (0.36 / 0.44 / 1.15 ms a scan at 200 / 1000 / 4000 tokens, 2-core
Zen 3): the price of not letting a lookup with nothing to say count as its controller's step.
A controller observes only the steps it chose for: the ones it drafted, and plain steps after
it said 0 (so its one-row cost stays its own). A draft that carries the drafter's own survival
estimates (DSpark's confidence head) is cut by its controller where the expected gain per
second of verify ends (KController.cut). A member that prices its own depth (`prices_depth`:
the suffix cache, whose survival follows the match's length) is asked for up to the cap, not
for a k chosen beforehand, and verified as deep as its survival pays, or not at all
(KController.depth_for): the controller's k learns a position past it one exploration at a
time, and on an exact repeat, where every draft was accepted, held the drafts to 2.3-3.1
tokens a step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from app.core.adaptive import KController, Load
from app.core.drafting import Proposal, alone, proposal
from app.core.protocols import Drafter, Members, ReadsContext
from app.core.types import Draft


class AutoK:
    """Chooses each step's drafting member and k, and routes the step's outcome back."""

    def __init__(self, drafter: Drafter, controllers: Sequence[KController]) -> None:
        members = tuple((drafter.members if isinstance(drafter, Members) else None) or (drafter,))
        if len(members) != len(controllers):
            raise ValueError(f"{len(members)} members, {len(controllers)} controllers")
        self._pairs = tuple(zip(members, controllers))
        self._asked: list[KController] = []  # controllers that chose this step
        self._said: list[int] = []  # what each chose, before the step's token cap
        self._drafting: KController | None = None  # the one whose member drafted

    @property
    def k_max(self) -> int:
        return max(controller.k_max for _, controller in self._pairs)

    @property
    def off(self) -> bool:
        """Whether this step's controllers were asked and every one said 0."""
        return bool(self._said) and not any(self._said)

    def start(self, verify_costs: Mapping[int, float] | None) -> None:
        """A new generation; verify_costs seed controllers that have no cost curve yet."""
        for _, controller in self._pairs:
            controller.new_text()
            if not controller.verify_s and verify_costs:
                controller.seed_costs(verify_costs)

    def needs_costs(self) -> bool:
        return any(not controller.verify_s for _, controller in self._pairs)

    @property
    def off_by_load(self) -> bool:
        """Whether this step was plain only because the other streams fill the forward."""
        return self.off and any(controller.off_by_load for controller in self._asked)

    def propose(self, context: Sequence[int], cap: int, load: Load | None = None) -> Draft:
        """The step's draft (empty: a plain step); no more than cap tokens. load: what the
        other streams put in the step's forward (batched streams)."""
        return alone(self.propose_steps(context, cap, load))

    def propose_steps(self, context: Sequence[int], cap: int, load: Load | None = None
                      ) -> Proposal:
        """propose, the drafting member's forwards yielded (app/core/drafting.py)."""
        self._asked, self._said, self._drafting = [], [], None
        for _, controller in self._pairs:
            controller.load = load or Load()
        last = len(self._pairs) - 1
        for i, (member, controller) in enumerate(self._pairs):
            # a lookup: whether it has a continuation at all, before its controller counts
            if i < last and (cap <= 0 or not member.propose(context, 1).tokens):
                continue
            self._asked.append(controller)
            if getattr(member, "prices_depth", False):
                draft = yield from self._priced(member, controller, context, cap)
            else:
                draft = yield from self._chosen(member, controller, context, cap)
            if draft.tokens:
                self._drafting = controller
                return draft if draft.source else replace(draft, source=member.name)
        return Draft()

    def _chosen(self, member: Drafter, controller: KController, context: Sequence[int],
                cap: int) -> Proposal:
        """The member's draft at the k its controller chooses (empty: it said 0)."""
        self._said.append(controller.choose())
        k = min(self._said[-1], cap)
        if k > 0 and not controller.read_pays(_unread(member, context), cap):
            self._said[-1] = k = 0  # its read would cost more than drafting can save
        if k <= 0:
            return Draft()
        draft = (yield from proposal(member, context, k)).within(k)
        if draft.survival:  # the drafter's own estimates say where the gain ends
            draft = draft.within(controller.cut(draft.survival))
        return draft

    def _priced(self, member: Drafter, controller: KController, context: Sequence[int],
                cap: int) -> Proposal:
        """The member's draft as deep as its own survival pays for (empty: none pays)."""
        draft = yield from proposal(member, context, cap)
        self._said.append(controller.depth_for(draft) if draft.survival else 0)
        return draft.within(self._said[-1]) if self._said[-1] else Draft()

    def observe(self, depth: int, n_accepted: int, draft_s: float, verify_s: float,
                other_s: float, source: str, rows: int, catch_up_s: float = 0.0,
                catch_up_rows: int = 0, reads_prompt: bool = False,
                load_rows: int = 0) -> None:
        """The step's outcome, to the controller that drafted it, or else (a plain step) to
        every controller that chose this step. load_rows: the other streams' rows in the
        step's forward."""
        if self._drafting is not None:
            self._drafting.observe(depth, n_accepted, draft_s, verify_s, other_s,
                                   source=source, rows=rows, catch_up_s=catch_up_s,
                                   catch_up_rows=catch_up_rows, reads_prompt=reads_prompt,
                                   load_rows=load_rows)
            return
        for controller in self._asked:
            controller.observe(0, 0, draft_s, verify_s, other_s, source=source, rows=1,
                               load_rows=load_rows)


def _unread(member: Drafter, context: Sequence[int]) -> int:
    """The context rows a member reads before its next draft: a draft model says
    (`unread_rows`); drafters that read nothing, or read it for free, do not."""
    return member.unread_rows(context) if isinstance(member, ReadsContext) else 0
