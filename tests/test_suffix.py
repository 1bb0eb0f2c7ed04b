"""Suffix drafting: matches, weights and depths as literal cases; the index equals a scan."""

from __future__ import annotations

import numpy as np

from app.drafters.suffix import (
    HISTORY,
    REQUEST,
    SEEDED,
    SuffixDrafter,
    SuffixIndex,
    continuations,
    request_match,
)


class Fixed:
    """A history of one partition: the records given."""

    def __init__(self, records, seeded=False):
        self.built = SuffixIndex.build([(r, seeded) for r in records])

    def index(self, partition):
        return self.built if partition == "local" else SuffixIndex.empty()


def drafter(records=(), seeded=False, **options) -> SuffixDrafter:
    made = SuffixDrafter(Fixed(records, seeded), **options)
    made.begin([], None, None, None)
    return made


def test_a_request_match_drafts_what_followed_it():
    draft = drafter(tree=False).propose([1, 2, 3, 4, 1, 2], 4)
    assert draft.tokens == (3, 4) and draft.source == f"suffix:{REQUEST}"


def test_the_draft_is_as_deep_as_the_match_earns_not_k():
    history = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 0]]
    assert drafter(history, tree=False).propose([7, 6], 8).tokens == (5, 4)
    assert drafter(history, tree=False).propose([9, 8, 7, 6], 8).tokens == (5, 4, 3, 2)
    assert drafter(history, tree=False).propose([9, 8, 7, 6], 3).tokens == (5, 4, 3)  # k caps


def test_continuations_are_weighted_by_how_often_each_followed():
    history = [[5, 6, 7, 8, 1]] * 3 + [[5, 6, 9, 2, 1]]
    draft = drafter(history).propose([3, 5, 6], 2)
    assert draft.tokens == (7, 8, 9, 2) and draft.parents == (-1, 0, -1, 2)
    assert draft.first_chain().tokens == (7, 8)  # the likeliest path first
    assert draft.source == f"suffix:{HISTORY}"


def test_continuations_below_the_minimum_probability_are_not_drafted():
    history = [[5, 6, 7, 8, 1]] * 19 + [[5, 6, 9, 2, 1]]
    draft = drafter(history).propose([5, 6], 2)
    assert 9 not in draft.tokens and draft.tokens == (7, 8)


def test_a_match_in_seeded_text_says_so():
    assert drafter([[1, 2, 3, 4]], seeded=True).propose([1, 2, 3], 1).source == \
        f"suffix:{SEEDED}"


def test_a_continuation_stops_at_its_records_end():
    draft = drafter([[4, 5, 6], [7, 7, 7]], tree=False).propose([4, 5, 6, 9, 4, 5], 4)
    assert draft.tokens == (6, 9)  # the request's (6 9 ...) beats the history's 6 then its end


def test_the_longer_match_wins_between_request_and_history():
    assert drafter([[1, 2, 3, 4, 5, 6]], tree=False).propose([0, 3, 9, 1, 2, 3], 4).tokens \
        == (4, 5, 6)


def test_a_member_behind_lookup_leaves_the_request_to_it():
    assert drafter(request=False, tree=False).propose([1, 2, 3, 4, 1, 2], 4).tokens == ()
    history = [[1, 2, 3, 4, 5, 6]]
    draft = drafter(history, request=False, tree=False).propose([9, 1, 2], 4)
    assert draft.tokens == (3, 4) and draft.source == f"suffix:{HISTORY}"
    assert drafter(request=False).bound("other").request is False


def test_min_match_holds_back_short_matches():
    assert drafter(min_match=3).propose([1, 2, 3, 4, 1, 2], 4).tokens == ()
    assert drafter(min_match=2).propose([1, 2, 3, 4, 1, 2], 4).tokens == (3, 4)


def test_an_index_built_in_steps_equals_one_built_at_once():
    rng = np.random.default_rng(0)
    records = [rng.integers(0, 6, size=n).tolist() for n in (30, 1, 17, 40)]
    stepwise = SuffixIndex.empty()
    for record in records:
        stepwise = stepwise.added([(record, False)])
    once = SuffixIndex.build([(r, False) for r in records])
    assert all(np.array_equal(a, b) for a, b in zip(stepwise.keys, once.keys))
    assert all(np.array_equal(a, b) for a, b in zip(stepwise.follows, once.follows))
    assert once.n_tokens == sum(map(len, records))


def test_the_index_finds_what_a_scan_finds():
    rng = np.random.default_rng(1)
    records = [rng.integers(0, 4, size=60).tolist() for _ in range(5)]
    index = SuffixIndex.build([(r, False) for r in records])
    for _ in range(50):
        context = rng.integers(0, 4, size=12).tolist()
        match = index.match(context, 2)
        longest = max((n for n in range(2, 13) for r in records
                       for i in range(len(r) - n)
                       if r[i:i + n] == context[-n:]), default=0)
        assert (match.length if match else 0) == longest, context
        if match:
            for start in match.starts:
                assert index.tokens[start - match.length:start].tolist() == \
                    context[-match.length:]


def test_a_request_match_uses_every_occurrence_of_the_longest_suffix():
    match = request_match([1, 2, 7, 1, 2, 8, 3, 2, 1, 2], 1)
    assert match.length == 2 and sorted(match.starts.tolist()) == [2, 5]
    draft, _ = continuations(match, 1, tree=True)
    assert sorted(draft.tokens) == [7, 8]
