"""k="auto" over a chain: each member drafts by its own controller's numbers."""

from __future__ import annotations

from app.core.adaptive import KController
from app.core.auto_k import AutoK
from app.core.types import Draft

FLAT = {n: 0.10 for n in range(1, 10)}  # verifying k + 1 rows costs one forward


class Scripted:
    """A drafter that proposes `available` continuation tokens, or nothing when 0."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, name: str, available: int = 8, full_only: bool = False) -> None:
        self.name, self.available, self.full_only = name, available, full_only
        self.calls: list[int] = []

    def propose(self, context, k: int) -> Draft:
        self.calls.append(k)
        if not self.available or (self.full_only and self.available < k):
            return Draft()
        return Draft(tokens=tuple(range(min(k, self.available))), source=self.name)


class Chain:
    def __init__(self, *members: Scripted) -> None:
        self.members, self.name = members, "chain"


def controllers(n: int) -> list[KController]:
    out = [KController(k_max=4) for _ in range(n)]
    for controller in out:
        controller.seed_costs(FLAT)
    return out


def step(auto: AutoK, accepted_by: dict[str, bool], draft_s: dict[str, float]) -> str:
    """One step: who drafted ("" for a plain step), its outcome fed back."""
    draft = auto.propose([1, 2, 3], cap=100)
    n = len(draft.tokens)
    accepted = n if accepted_by.get(draft.source, False) else 0
    auto.observe(n, accepted, draft_s.get(draft.source, 0.0) * n, FLAT[n + 1], 0.0,
                 source=draft.source, rows=n + 1)
    return draft.source


def test_a_lookup_that_pays_keeps_drafting_while_the_head_beside_it_is_off():
    lookup, head = Scripted("lookup"), Scripted("eagle3")
    auto = AutoK(Chain(lookup, head), controllers(2))
    auto.start(None)
    sources = []
    for i in range(300):
        lookup.available = 8 if i % 2 else 0  # a continuation on every other step
        sources.append(step(auto, {"lookup": True, "eagle3": False}, {"eagle3": 0.03}))
    late = sources[-100:]
    assert late[1::2].count("lookup") >= 48, "the lookup drafts wherever it matches"
    assert late[0::2].count("eagle3") <= 5, "the head, never accepted, is off"


def test_a_plain_step_reaches_only_the_controllers_that_chose_for_it():
    lookup, head = Scripted("lookup", available=0), Scripted("eagle3", available=0)
    lookup_ctl, head_ctl = controllers(2)
    auto = AutoK(Chain(lookup, head), [lookup_ctl, head_ctl])
    assert auto.propose([1, 2, 3], cap=100) == Draft()
    auto.observe(0, 0, 0.0, 0.05, 0.0, source="", rows=1)
    assert head_ctl.verify_s[1] < 0.10, "the head's controller chose, so it saw the plain step"
    assert lookup_ctl.verify_s[1] == 0.10, "the lookup had no continuation: not its step"


def test_a_lookup_shorter_than_its_k_leaves_the_step_to_the_model():
    lookup, model = Scripted("lookup", available=1, full_only=True), Scripted("draft")
    lookup_ctl, model_ctl = controllers(2)
    for controller in (lookup_ctl, model_ctl):
        controller.observe(3, 3, 0.0, FLAT[4], 0.0, source="x")  # costs known, k > 1 pays
    auto = AutoK(Chain(lookup, model), [lookup_ctl, model_ctl])
    draft = auto.propose([1, 2, 3], cap=100)
    assert draft.source == "draft" and len(draft.tokens) > 1


def test_a_single_drafter_is_its_own_only_member():
    drafter = Scripted("ngram")
    auto = AutoK(drafter, controllers(1))
    assert auto.propose([1, 2, 3], cap=2).tokens == (0,), "an unmeasured drafter drafts 1"
    assert auto.propose([1, 2, 3], cap=0) == Draft(), "no drafting past the token limit"


class Confident(Scripted):
    """A drafter whose drafts carry its own survival estimates, as DSpark's do."""

    def __init__(self, survival: tuple[float, ...]) -> None:
        super().__init__("dspark")
        self.survival = survival

    def propose(self, context, k: int) -> Draft:
        draft = super().propose(context, k)
        return Draft(draft.tokens, source=self.name, survival=self.survival[:len(draft.tokens)])


def test_the_controller_cuts_a_draft_where_its_survival_stops_paying_for_the_verify():
    controller = KController(k_max=4)
    controller.seed_costs({1: 0.10, 2: 0.10, 3: 0.11, 4: 0.12, 5: 0.13})
    survival = (0.9, 0.5, 0.1, 0.01)  # rates 19.0, 21.8, 20.8, 19.3 tokens/s: two drafts
    assert controller.cut(survival) == 2
    assert KController(k_max=4, verify_s=dict(FLAT)).cut(survival) == 4, \
        "verifying more rows costs nothing: every node with any chance is kept"


def test_auto_k_verifies_only_the_prefix_the_drafters_own_survival_pays_for():
    drafter = Confident((0.9, 0.5, 0.1, 0.01))
    controller = KController(k_max=4, prior_acceptance=0.9)
    controller.seed_costs({1: 0.10, 2: 0.10, 3: 0.11, 4: 0.12, 5: 0.13})
    controller.draft_costs["dspark"] = 0.001  # measured: cheap, so the controller asks for 4
    draft = AutoK(drafter, [controller]).propose([1, 2, 3], cap=100)
    assert drafter.calls == [4]
    assert draft.tokens == (0, 1) and draft.survival == (0.9, 0.5)


class Reading(Scripted):
    """A model member with `unread` context rows to read before its next draft."""

    def __init__(self, name: str, unread: int) -> None:
        super().__init__(name)
        self.unread = unread

    def unread_rows(self, context) -> int:
        return self.unread


def test_a_model_whose_prompt_read_cannot_be_repaid_leaves_the_step_plain():
    model = Reading("draft", unread=800)
    controller = KController(k_max=4)
    controller.seed_costs(FLAT)
    controller.observe(1, 1, 0.05, 0.10, 0.0, source="draft", catch_up_s=0.4,
                       catch_up_rows=200)  # 2 ms a row: 1.6 s for 800 rows
    auto = AutoK(model, [controller])
    assert controller.choose() > 0  # it would draft, were the prompt read
    assert auto.propose([1, 2, 3], cap=10).tokens == () and auto.off
    assert model.calls == []  # nothing asked of the model: its prompt stays unread
    assert auto.propose([1, 2, 3], cap=2000).tokens  # a long budget repays the read
    model.unread = 0
    assert auto.propose([1, 2, 3], cap=10).tokens  # read already: it drafts


class Priced(Scripted):
    """A member whose drafts price their own depth (the suffix cache's, calibrated)."""

    prices_depth = True

    def __init__(self, survival: tuple[float, ...]) -> None:
        super().__init__("suffix", available=len(survival))
        self.survival = survival

    def propose(self, context, k: int) -> Draft:
        draft = super().propose(context, k)
        return Draft(draft.tokens, source=self.name, survival=self.survival[:len(draft.tokens)])


LINEAR = {n: 0.04 + 0.016 * (n - 1) for n in range(1, 10)}  # a 2-core CPU's verify rows


def test_a_member_that_prices_its_depth_drafts_past_the_controllers_k():
    sure = Priced(tuple(0.99 ** j for j in range(1, 33)))
    controller = KController(k_max=4, verify_s=dict(LINEAR))
    draft = AutoK(sure, [controller]).propose([1, 2, 3], cap=100)
    assert sure.calls == [100], "asked for all it has, not for a k chosen beforehand"
    assert 8 < len(draft.tokens) < 32, "cut where an extra row costs more than it commits"


def test_a_priced_member_whose_survival_does_not_pay_leaves_the_step_to_the_next_member():
    doubtful, model = Priced((0.3, 0.1, 0.03)), Scripted("draft")
    controllers = [KController(k_max=4, verify_s=dict(LINEAR)) for _ in range(2)]
    controllers[1].draft_costs["draft"] = 0.001
    draft = AutoK(Chain(doubtful, model), controllers).propose([1, 2, 3], cap=100)
    assert draft.source == "draft"
