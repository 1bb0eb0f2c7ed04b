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
    from app.drafters.chain import ChainDrafter
    from app.drafters.draft_model import DraftModelDrafter
    from app.drafters.ngram import NgramDrafter

    prompt = [5, 9, 12, 5, 9, 3, 7, 5, 9]
    params = SamplingParams(max_new_tokens=40)
    plain = list(SpecEngine(target).generate(prompt, params))[-1]
    lookup_then_model = ChainDrafter((NgramDrafter(min_n=2, full_only=True, name="lookup"),
                                      DraftModelDrafter(target, unrelated)))
    for drafter in (NgramDrafter(), DraftModelDrafter(target, unrelated),
                    DraftModelDrafter(target, target), lookup_then_model):
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


def row_cost(rows: float) -> float:
    return 0.10 + 0.03 * (rows - 1)  # each verify row adds 30% of a one-row forward (a CPU)


ROWS = {n: row_cost(n) for n in range(1, 10)}  # what the engine probes for k_max 8


def eagle2_rows(depth: int) -> int:
    return 1 + min(4 * depth, 16)  # 4 children per level, 16 nodes at most


def feed_depths(controller: KController, rows_of, accepted: int, rounds: int = 10) -> None:
    """Steps at every depth (as exploration reaches them), each accepting `accepted` levels."""
    for _ in range(rounds):
        for depth in range(1, controller.k_max + 1):
            rows = rows_of(depth)
            controller.observe(depth, min(accepted, depth), 0.01 * depth, row_cost(rows), 0.0,
                               source="eagle3-tree", rows=rows)


def test_a_tree_whose_rows_cost_more_than_its_accepted_tokens_is_turned_off():
    controller = KController(k_max=8)
    controller.seed_costs(ROWS)
    feed_depths(controller, eagle2_rows, accepted=1)
    # depth 1 commits ~2 tokens for 5 rows (0.22 s) and a level (0.01 s): 8.7 tok/s < plain 10
    assert controller.choose() == 0


def test_a_chain_is_still_priced_at_k_plus_one_rows():
    controller = KController(k_max=8)
    controller.seed_costs(ROWS)
    feed_depths(controller, lambda depth: depth + 1, accepted=1)
    assert [controller.rows(k) for k in range(9)] == list(range(1, 10))
    draft_s = 3 * (controller.draft_token_s or 0.0)
    assert controller.step_seconds(3) == draft_s + controller.verify_s[4] + controller.overhead_s
    # the same acceptance and costs as the tree above, on 2 rows: 2 tokens / 0.14 s pays
    assert controller.choose() == 1


def test_a_tree_whose_accepted_tokens_pay_for_its_rows_keeps_speculating():
    controller = KController(k_max=8)
    controller.seed_costs(FLAT)
    for _ in range(10):
        for depth in range(1, 9):
            controller.observe(depth, depth, 0.0, 0.10, 0.0, rows=eagle2_rows(depth))
    assert controller.choose() == 8


def test_an_unseen_depth_is_priced_with_at_least_the_rows_of_the_deepest_shallower_one_seen():
    controller = KController(k_max=8)
    controller.observe(2, 1, 0.02, 0.1, 0.0, rows=9)
    assert controller.rows(1) == 2  # nothing seen at or below depth 1: a chain's rows
    assert controller.rows(2) == 9
    assert controller.rows(5) == 9  # a depth-5 tree holds its depth-2 cut
    assert controller.rows(9) == 10  # never fewer than a chain's


DRAFT_S = 0.05  # half a target forward per draft token: one accepted token does not repay it


def off_controller() -> KController:
    """A controller that has learnt its drafter loses: every draft rejected, drafting dear."""
    controller = KController(k_max=4, explore_every=8, max_explore_gap=64)
    controller.seed_costs(FLAT)
    feed(controller, 30, n_drafted=2, n_accepted=0, draft_s=2 * DRAFT_S)
    return controller


def run_plain(controller: KController, steps: int) -> list[int]:
    """Choose `steps` times; rejected drafts and plain steps observed as they happen."""
    choices = []
    for _ in range(steps):
        k = controller.choose()
        controller.observe(k, 0, k * DRAFT_S, controller.verify_cost(k + 1), 0.0)
        choices.append(k)
    return choices


def test_a_long_plain_stretch_keeps_speculation_off_but_for_explorations():
    controller = off_controller()
    choices = run_plain(controller, 300)
    # explorations only: after 8, 16, 32, then every 64 steps (evidence aged every step had
    # let the prior of 0.6 take over and turn speculation back on)
    assert sum(k > 0 for k in choices) <= 7


def test_an_exploration_that_pays_brings_the_next_one_sooner():
    controller = off_controller()
    run_plain(controller, 8 + 16 + 32 + 64)  # the wait has grown to its cap
    for _ in range(64):
        k = controller.choose()
        if k:
            controller.observe(k, k, k * DRAFT_S, controller.verify_cost(k + 1), 0.0)
            break
        controller.observe(0, 0, 0.0, controller.verify_cost(1), 0.0)
    choices = run_plain(controller, 9)
    assert any(choices)  # explored again within explore_every steps, not 64


def test_a_new_generation_caps_the_wait_for_the_next_exploration():
    controller = off_controller()
    controller.new_text_gap = 32
    run_plain(controller, 8 + 16 + 32 + 64)  # explored at the last step; the wait is now 64
    controller.new_text()
    choices = run_plain(controller, 32)
    assert any(choices[-1:]) and not any(choices[:-1])


def test_an_exploration_whose_rows_cost_more_than_its_accepted_token_keeps_the_long_wait():
    controller = off_controller()
    run_plain(controller, 8 + 16 + 32 + 64)
    for _ in range(64):
        k = controller.choose()
        if k:  # a tree's first level accepted, verified over 17 rows at 5x a plain step
            controller.observe(k, k, k * DRAFT_S, 0.5, 0.0, rows=17)
            break
        controller.observe(0, 0, 0.0, controller.verify_cost(1), 0.0)
    assert not any(run_plain(controller, 9))


def test_a_plain_cost_overstated_by_the_probe_is_retimed_and_a_weak_drafter_turned_off():
    # the probe ran while another process held the cores: one row looked 3x its cost
    controller = KController(k_max=4)
    controller.seed_costs({1: 0.30, 2: 0.36, 3: 0.39, 4: 0.45, 5: 0.54})
    true_cost = {1: 0.10, 2: 0.12, 3: 0.13, 4: 0.15, 5: 0.18}
    choices = []
    for step in range(200):
        k = controller.choose()
        choices.append(k)
        accepted = 1 if k and step % 5 == 0 else 0  # 20% of first drafts accepted
        controller.observe(k, accepted, 0.01 * k, true_cost[k + 1], 0.0)
    assert any(choices[:32]), "the overstated plain cost made speculation look worth it"
    assert choices[-40:].count(0) >= 36, "a 0.12 s step for 1.2 tokens loses to 0.10 s for 1"


def test_a_speculating_controller_retimes_plain_ever_more_rarely_while_it_agrees():
    controller = KController(k_max=4, plain_every=8, max_explore_gap=32)
    controller.seed_costs(FLAT)
    feed(controller, 40, n_drafted=4, n_accepted=4, draft_s=0.0)
    plain = []
    for step in range(120):
        k = controller.choose()
        if k == 0:
            plain.append(step)
        controller.observe(k, k, 0.0, FLAT[k + 1], 0.0)
    assert plain == [7, 23, 55, 87, 119]  # gaps of 8, 16, 32, then capped at 32


def test_a_draft_that_promises_less_than_the_margin_over_plain_is_not_chosen():
    # one-row verify 0.10 s, two rows 0.11 s, a draft token 0.03 s: k=1 at 50% acceptance
    # commits 1.5 tokens in 0.14 s, 1.07x plain: enough over a 5% margin, not over 10%
    costs = {1: 0.10, 2: 0.11, 3: 0.12}
    near = KController(k_max=2, prior_weight=1e-9, decay=1.0)
    near.seed_costs(costs)
    feed(near, 40, n_drafted=1, n_accepted=0, draft_s=0.03)
    feed(near, 40, n_drafted=1, n_accepted=1, draft_s=0.03)
    assert near.choose() == 1
    strict = KController(k_max=2, prior_weight=1e-9, decay=1.0, pay_margin=0.10)
    strict.seed_costs(costs)
    feed(strict, 40, n_drafted=1, n_accepted=0, draft_s=0.03)
    feed(strict, 40, n_drafted=1, n_accepted=1, draft_s=0.03)
    assert strict.choose() == 0


def test_a_drafters_catch_up_read_never_enters_the_per_step_overhead():
    controller = KController(k_max=4)
    controller.seed_costs(FLAT)
    controller.observe(2, 1, 0.02, 0.10, 0.001, source="draft", catch_up_s=0.5)
    assert controller.overhead_s == 0.001
    assert controller.draft_costs["draft"] == 0.02 / 2


def test_a_new_generation_weighs_the_last_texts_acceptance_half():
    controller = KController(k_max=2, prior_weight=1e-9, decay=1.0)
    controller.seed_costs(FLAT)
    feed(controller, 20, n_drafted=2, n_accepted=2, draft_s=0.0)
    controller.new_text()
    feed(controller, 10, n_drafted=2, n_accepted=0, draft_s=0.0)
    # 20 steps that accepted both, kept as 10, against 10 that accepted none
    assert abs(controller.acceptance()[0] - 0.5) < 1e-6


def test_a_prompt_read_that_drafting_cannot_repay_within_the_budget_is_not_paid():
    # plain 0.10 s a token; k=1 at 7/11 acceptance: 1.64 tokens in 0.11 + 0.04 s, 0.0917 s
    # a token, 0.0083 s saved a token; reads measured at 2 ms a row
    controller = KController(k_max=1, prior_weight=1e-9, decay=1.0)
    controller.seed_costs({1: 0.10, 2: 0.11})
    assert controller.read_pays(800, 127)  # reads not priced yet: the first one measures
    feed(controller, 6, n_drafted=1, n_accepted=1, draft_s=0.04)
    feed(controller, 4, n_drafted=1, n_accepted=0, draft_s=0.04)
    controller.observe(1, 1, 0.04, 0.11, 0.0, source="draft", catch_up_s=0.2,
                       catch_up_rows=100, reads_prompt=True)
    assert controller.read_rows == 100
    assert not controller.read_pays(800, 127)  # 1.6 s to read, 1.06 s to save: no
    assert controller.read_pays(800, 400) and controller.read_pays(50, 127)
    assert not controller.read_pays(50, 5)


def test_one_row_never_costs_more_than_the_cheapest_forward_measured():
    controller = KController(k_max=2)
    controller.seed_costs({1: 0.050, 2: 0.045, 3: 0.047})  # the one-row average ran high
    assert controller.verify_cost(1) == 0.045
    assert controller.verify_cost(2) == 0.045 and controller.verify_cost(3) == 0.047


def test_an_exploration_reads_only_what_a_text_as_good_as_the_prior_would_repay():
    # drafting pays nothing by the estimates (every draft rejected); an exploration asks
    # whether a prior-like text (60% acceptance) would repay the rows it reads first
    def explorer(draft_s: float) -> KController:
        controller = KController(k_max=1, prior_weight=1e-9, decay=1.0, explore_every=1)
        controller.seed_costs({1: 0.10, 2: 0.11})
        feed(controller, 10, n_drafted=1, n_accepted=0, draft_s=draft_s)
        controller.observe(1, 0, draft_s, 0.11, 0.0, source="draft", catch_up_s=0.2,
                           catch_up_rows=100)  # 2 ms a row
        controller.choose()  # off, and the first step off explores
        assert controller._exploring
        return controller

    assert explorer(0.01).read_pays(64, 100)  # a cheap draft: a good text repays 64 rows
    assert not explorer(0.05).read_pays(64, 100)  # no text at 60% repays this draft at all


def test_a_slow_step_moves_a_forwards_cost_less_than_a_fast_one():
    controller = KController(k_max=1)
    controller.seed_costs({1: 0.040, 2: 0.045})
    controller.observe(0, 0, 0.0, 0.080, 0.0)  # another process slowed one plain step
    slowed = controller.verify_s[1]
    assert 0.040 < slowed < 0.040 + 0.1 * 0.040
    controller.observe(0, 0, 0.0, 0.040, 0.0)
    assert controller.verify_s[1] - 0.040 < (slowed - 0.040) / 2  # back down quickly
