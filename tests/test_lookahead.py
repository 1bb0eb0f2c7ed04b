"""Lookahead decoding: the tree it proposes and the Jacobi window it keeps, as literal tables;
losslessness through the engine (greedy oracle on a tiny torch model and the numpy fake, k in
1, 2, 4, 7; sampled output keeps the target's law)."""

from __future__ import annotations

import numpy as np
import pytest

from app.core.engine import SpecEngine
from app.core.feed import StepFeed
from app.core.sampling import warp
from app.core.types import SamplingParams
from app.drafters import build_drafter
from app.drafters.lookahead import LookaheadDrafter, NgramPool
from tests.distributions import assert_follows
from tests.fakes import FakeModel


def rows(*argmax: int) -> StepFeed:
    """A verify's feed as lookahead reads it: the argmax of every row."""
    return StepFeed(tokens=(0,), start=0, rows=(0,), next_token=0, argmax=tuple(argmax))


def started(**kwargs) -> LookaheadDrafter:
    drafter = LookaheadDrafter(**kwargs)
    drafter.begin([], None, SamplingParams(), np.random.default_rng(0))
    return drafter


def test_the_first_step_drafts_the_seeded_trunk_as_a_chain_after_the_pending_token():
    drafter = started(level=3, window=3, guesses=2)
    draft = drafter.propose([10, 11, 12, 13, 14], k=4)
    # the trunk is seeded with context tokens in order; no pool entry follows 14 yet
    assert (draft.tokens, draft.parents) == ((10, 11), (-1, 0))
    assert drafter.pool.guesses(12) == [(13, 14)]  # every 3-gram of the context is pooled


def test_warm_up_slides_the_trunk_and_adds_the_jacobi_iterate_as_the_next_level():
    drafter = started(level=3, window=3, guesses=2)
    drafter.propose([10, 11, 12, 13, 14], k=4)
    drafter.accept(rows(20, 21, 22))  # argmax at the pending token, 10 and 11
    assert drafter.levels == [[11, 12], [21, 22, 13]]  # padded with context tokens in order
    draft = drafter.propose([10, 11, 12, 13, 14, 20], k=4)
    # level 1 hangs below the trunk: column 0 under the pending token, column j under trunk j
    assert draft.tokens == (11, 12, 21, 22, 13)
    assert draft.parents == (-1, 0, -1, 0, 1)
    assert draft.depths() == (1, 2, 1, 2, 3)


def test_a_full_window_feeds_the_pool_column_by_column_and_slides_one_column():
    drafter = started(level=3, window=3, guesses=2)
    drafter.propose([10, 11, 12, 13, 14], k=4)
    drafter.accept(rows(20, 21, 22))
    drafter.propose([10, 11, 12, 13, 14, 20], k=4)
    drafter.accept(rows(30, 31, 32, 33, 34, 35))  # deepest nodes: rows 3, 4, 5
    assert drafter.pool.guesses(20) == [(21, 33)]  # key: the pending token (column 0)
    assert drafter.pool.guesses(11) == [(22, 34), (12, 13)]  # key: trunk token; most recent first
    assert drafter.pool.guesses(12) == [(13, 35), (13, 14)]
    assert drafter.levels == [[22, 13], [33, 34, 35]]


def test_pool_guesses_lead_the_tree_and_share_nodes_with_the_window():
    drafter = started(level=3, window=3, guesses=2)
    drafter.propose([10, 11, 12, 13, 14], k=4)
    drafter.accept(rows(20, 21, 22))
    drafter.propose([10, 11, 12, 13, 14, 20], k=4)
    drafter.accept(rows(30, 31, 32, 33, 34, 35))
    drafter.levels = [[22, 13], [31, 34, 35]]  # column 0's level 1 agrees with a guess
    draft = drafter.propose([10, 11, 12, 13, 14, 20, 31, 20], k=4)
    # guesses for 20, most recent first: (31, 20) from the output, (21, 33) from the window;
    # then the trunk 22 13; column 0's 31 is the guess's node 0; columns 1, 2 hang below 22, 13
    assert draft.tokens == (31, 20, 21, 33, 22, 13, 34, 35)
    assert draft.parents == (-1, 0, -1, 2, -1, 4, 4, 5)
    drafter.accept(rows(*range(40, 49)))
    assert drafter.levels[-1] == [41, 47, 48]  # new[j]: the rows after nodes 0, 6 and 7


def test_the_pool_keeps_the_most_recent_continuations_within_its_size():
    pool = NgramPool(2)
    for continuation in [(1,), (2,), (1,), (3,)]:
        pool.add(7, continuation)
    assert pool.guesses(7) == [(3,), (1,)]
    assert NgramPool(0).guesses(7) == [] and pool.guesses(8) == []


@pytest.mark.parametrize("k", [1, 2, 4, 7, 12])
def test_no_node_is_deeper_than_k(k):
    drafter = started(level=5, window=7, guesses=7)
    context = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    for step in range(6):
        draft = drafter.propose(context, k)
        assert max(draft.depths(), default=0) <= k
        argmax = [(t * 7 + step) % 10 for t in (context[-1], *draft.tokens)]
        drafter.accept(rows(*argmax))
        context = [*context, argmax[0]]


def test_a_verified_output_that_is_not_its_tree_leaves_the_window_as_it_was():
    drafter = started(level=3, window=3, guesses=2)
    drafter.propose([10, 11, 12, 13, 14], k=4)
    before = [list(level) for level in drafter.levels]
    drafter.accept(rows(20))  # a backend without trees verified only the first chain
    assert drafter.levels == before


def test_bad_window_sizes_are_refused():
    with pytest.raises(ValueError):
        LookaheadDrafter(level=1)


def test_the_factory_builds_lookahead():
    assert isinstance(build_drafter("lookahead", None), LookaheadDrafter)


# ---- lossless through the engine -----------------------------------------------------------

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9, 12, 5, 9]


def oracle(target, prompt, n):
    done = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=n)))[-1]
    return list(done.token_ids)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_lookahead_gives_exactly_the_oracles_tokens_on_a_tiny_torch_model(target, k):
    truth = oracle(target, PROMPT, 40)
    done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=40),
                                            drafter=LookaheadDrafter(), k=k))[-1]
    assert list(done.token_ids) == truth
    assert done.stats.drafted > 0


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_lookahead_gives_exactly_the_oracles_tokens_on_the_numpy_fake(k):
    model = FakeModel(vocab=12, seed=k)
    truth = oracle(model, [0, 3, 5], 40)
    done = list(SpecEngine(model).generate([0, 3, 5], SamplingParams(max_new_tokens=40),
                                           drafter=LookaheadDrafter(), k=k))[-1]
    assert list(done.token_ids) == truth


def test_ngrams_the_jacobi_window_harvested_get_accepted_where_the_context_has_none():
    vocab = 16
    table = np.full((vocab, vocab), -10.0)
    table[np.arange(vocab), (np.arange(vocab) + 1) % vocab] = 10.0  # next token: t + 1
    model = FakeModel(table=table)
    prompt = [0, 5, 9, 3, 12]  # no earlier n-gram of the prompt or output ever counts on
    done = list(SpecEngine(model).generate(prompt, SamplingParams(max_new_tokens=14),
                                           drafter=LookaheadDrafter(), k=4))[-1]
    assert list(done.token_ids) == [(13 + i) % vocab for i in range(14)]
    assert done.stats.accepted > 0


def test_sampled_lookahead_commits_tokens_from_the_targets_own_distribution():
    vocab = 5
    model = FakeModel(vocab=vocab, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    p = warp(model.table.astype(np.float64), params)
    engine = SpecEngine(model)
    prompt = [0, 1, 0, 2, 0]  # the pool has guesses after 0 from the start
    counts = np.zeros((vocab, vocab, vocab))
    n = 6000
    for seed in range(n):
        done = list(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3,
                                                           seed=seed),
                                    drafter=LookaheadDrafter(level=3, window=2), k=2))[-1]
        counts[tuple(done.token_ids[:3])] += 1
    expected = (p[0][:, None, None] * p[:, :, None] * p[None, :, :]).ravel() * n
    observed = counts.ravel()
    assert_follows(observed, expected)
    assert 0.5 * np.abs(observed / n - expected / n).sum() < 0.05
