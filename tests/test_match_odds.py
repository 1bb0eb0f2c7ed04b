"""MatchOdds: a suffix match's continuation judged against the text that followed it, by the
match's length, and the survival a draft then carries."""

from __future__ import annotations

import pytest

from app.drafters.match_odds import PRIOR, MatchOdds, Prediction, bucket
from app.drafters.suffix import SuffixDrafter, SuffixIndex


def test_match_lengths_fall_in_doubling_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 7, 8, 63, 64, 500)] == [0, 1, 1, 2, 2, 3, 5, 6, 6]


def test_an_unjudged_match_starts_from_the_prior():
    assert MatchOdds().survival(10, [1.0, 1.0]) == pytest.approx((PRIOR, PRIOR ** 2))


def test_a_long_match_that_kept_being_right_earns_more_survival_than_a_short_one_that_missed():
    odds = MatchOdds()
    for _ in range(30):
        odds.judge(64, [1.0] * 8, n_right=8, missed=False)  # a repeat: every token right
        odds.judge(4, [1.0] * 3, n_right=1, missed=True)  # a template: new arguments after it
    long, short = odds.survival(64, [1.0] * 4), odds.survival(4, [1.0] * 4)
    assert long[-1] > 0.9 and short[0] < 0.6 and short[-1] < 0.1


def test_the_counts_probability_is_calibrated_not_replaced():
    odds = MatchOdds()
    for _ in range(50):  # tokens the counts gave a half chance were right half the time
        odds.judge(16, [0.5], n_right=1, missed=False)
        odds.judge(16, [0.5], n_right=0, missed=True)
    assert odds.survival(16, [0.5])[0] == pytest.approx(0.5, abs=0.02)


def test_a_prediction_waits_for_the_text_unless_told_to_judge_now():
    odds, made = MatchOdds(), Prediction(2, (7, 8, 9), 8, (1.0, 1.0, 1.0))
    assert not made.settle([0, 0, 7], odds, final=False), "8 and 9 not yet written"
    assert made.settle([0, 0, 7, 8, 4], odds, final=False), "9 was not what followed"
    # matches of 8, 9 and 10 tokens, one bucket: two right of three judged (decayed a little)
    assert odds.right[bucket(8)] == pytest.approx(2.0, abs=0.05)
    assert odds.expected[bucket(8)] == pytest.approx(3.0, abs=0.05)
    cut_short, fresh = Prediction(0, (7, 8, 9), 8, (1.0, 1.0, 1.0)), MatchOdds()
    assert cut_short.settle([7], fresh, final=True)
    assert fresh.right[bucket(8)] == fresh.expected[bucket(8)] == 1.0, "only 7 was judged"


class Fixed:
    def __init__(self, records):
        self.built = SuffixIndex.build([(r, False) for r in records])

    def index(self, partition):
        return self.built


def test_the_drafter_learns_from_the_text_that_followed_even_where_another_member_drafted():
    record = list(range(100, 140))
    drafter = SuffixDrafter(Fixed([record]), tree=False, request=False)
    drafter.begin([], None, None, None)
    context = [1, 2, *record[:10]]
    before = drafter.propose(context, 32).survival
    for step in range(10, 30, 5):  # the text follows the record; the drafter is asked anew
        drafter.propose([1, 2, *record[:step]], 1)
    after = drafter.propose([1, 2, *record[:30]], 32).survival
    assert len(after) == len(before) == 10, "as deep as the record's rest"
    assert after[-1] > before[-1] and after[0] > PRIOR


def test_bound_drafters_of_one_partition_share_its_odds_and_no_other_partitions():
    drafter = SuffixDrafter(Fixed([list(range(50))]), tree=False)
    drafter.odds.judge(20, [1.0], n_right=1, missed=False)
    assert drafter.bound("local").odds is drafter.odds
    assert drafter.bound("key-b").odds is not drafter.odds
    assert drafter.bound("key-b").odds is drafter.bound("key-b").odds
