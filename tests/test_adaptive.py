"""The k chooser: off when speculation cannot pay, long drafts when acceptance is high."""

from __future__ import annotations

from app.core.adaptive import KController

FLAT = {n: 0.10 for n in range(1, 10)}  # verification as cheap as one token (memory bound)
STEEP = {n: 0.10 * n for n in range(1, 10)}  # every extra row costs a full forward


def feed(controller: KController, steps: int, n_drafted: int, n_accepted: int,
         draft_s: float) -> None:
    for _ in range(steps):
        controller.observe(n_drafted, n_accepted, draft_s, controller.verify_cost(n_drafted + 1),
                           0.0)


def test_high_acceptance_on_a_flat_cost_curve_picks_a_long_draft():
    controller = KController(k_max=8)
    controller.seed_costs(FLAT)
    feed(controller, 40, n_drafted=8, n_accepted=8, draft_s=0.0)
    assert controller.choose() == 8


def test_a_steep_cost_curve_turns_speculation_off():
    controller = KController(k_max=8)
    controller.seed_costs(STEEP)
    feed(controller, 40, n_drafted=4, n_accepted=2, draft_s=0.0)
    assert controller.choose() == 0


def test_expensive_drafting_with_low_acceptance_turns_speculation_off():
    controller = KController(k_max=8)
    controller.seed_costs(FLAT)
    feed(controller, 40, n_drafted=4, n_accepted=0, draft_s=4 * 0.05)
    assert controller.choose() == 0


def test_moderate_acceptance_with_a_costly_drafter_picks_a_short_draft():
    controller = KController(k_max=8)
    controller.seed_costs({1: 0.10, 2: 0.11, 3: 0.12, 5: 0.14, 9: 0.18})
    feed(controller, 60, n_drafted=3, n_accepted=2, draft_s=3 * 0.03)
    assert 1 <= controller.choose() <= 4


def test_while_off_it_explores_again_ever_more_rarely():
    controller = KController(k_max=4, explore_every=5, max_explore_gap=20)
    controller.seed_costs(STEEP)
    feed(controller, 40, n_drafted=4, n_accepted=0, draft_s=0.0)
    choices = [controller.choose() for _ in range(75)]
    explored = [i for i, k in enumerate(choices) if k > 0]
    assert explored == [4, 14, 34, 54, 74]  # gaps of 5, 10, 20, then capped at 20


def test_acceptance_estimates_are_conditional_per_position():
    controller = KController(k_max=3, prior_weight=1e-9, decay=1.0)
    for accepted in (0, 1, 3, 3):
        controller.observe(3, accepted, 0.0, 0.1, 0.0)
    a1, a2, a3 = controller.acceptance()
    assert abs(a1 - 3 / 4) < 1e-6  # 4 steps reached position 1, 3 accepted it
    assert abs(a2 - 2 / 3) < 1e-6  # 3 reached position 2, 2 accepted it
    assert abs(a3 - 2 / 2) < 1e-6


def test_unmeasured_verify_sizes_are_interpolated():
    controller = KController()
    controller.seed_costs({1: 1.0, 5: 2.0})
    assert controller.verify_cost(3) == 1.5
    assert controller.verify_cost(9) == 3.0


def test_auto_k_keeps_the_output_of_plain_decoding(target, unrelated):
    from app.core.engine import SpecEngine
    from app.core.types import SamplingParams
    from app.drafters.draft_model import DraftModelDrafter
    from app.drafters.ngram import NgramDrafter

    prompt = [5, 9, 12, 5, 9, 3, 7, 5, 9]
    params = SamplingParams(max_new_tokens=40)
    plain = list(SpecEngine(target).generate(prompt, params))[-1]
    for drafter in (NgramDrafter(), DraftModelDrafter(target, unrelated),
                    DraftModelDrafter(target, target)):
        engine = SpecEngine(target, drafter, k="auto")
        done = list(engine.generate(prompt, params))[-1]
        assert done.token_ids == plain.token_ids, drafter.name
        assert engine.controller(drafter, "auto").verify_s, "the verify cost curve was probed"


BLOCKY = {1: 0.10, 2: 0.11, 3: 0.12, 4: 0.13, 5: 0.30}  # cheap up to 4 rows, then a jump


def test_a_speculating_controller_now_and_then_drafts_one_more_to_learn_the_next_position():
    controller = KController(k_max=4, explore_every=4)
    controller.seed_costs(BLOCKY)
    feed(controller, 40, n_drafted=1, n_accepted=1, draft_s=0.035)
    choices = [controller.choose() for _ in range(8)]
    assert choices == [1, 1, 1, 2, 1, 1, 1, 2]


def test_a_pair_that_agrees_climbs_from_k1_to_the_k_its_cost_curve_rewards():
    controller = KController(k_max=4)
    controller.seed_costs(BLOCKY)
    feed(controller, 40, n_drafted=1, n_accepted=1, draft_s=0.035)
    assert controller.choose() == 1  # deeper positions unseen: their prior looks too risky
    for _ in range(300):
        k = controller.choose()
        controller.observe(k, k, 0.035 * k, BLOCKY[k + 1], 0.0)  # every draft accepted
    assert controller.choose() == 3  # 4 rows still cheap; the 5-row jump is not worth it


def test_before_any_draft_is_timed_it_drafts_one_token_to_measure_the_cost():
    controller = KController(k_max=8)
    controller.seed_costs(FLAT)
    assert controller.choose() == 1
    controller.observe(1, 1, 0.0, 0.10, 0.0)  # a free drafter (prompt lookup)
    assert controller.choose() > 1
