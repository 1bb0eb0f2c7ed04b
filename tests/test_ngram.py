"""Prompt lookup proposals as literal tables."""

from __future__ import annotations

import pytest

from app.drafters.ngram import NgramDrafter, propose_lookup

CASES = [
    # (context, k, min_n, max_n, proposal, why)
    ([1, 2, 3, 4, 1, 2], 2, 1, 4, (3, 4), "suffix [1, 2] seen before: propose what followed"),
    ([1, 2, 3, 4, 1, 2], 5, 1, 4, (3, 4, 1, 2), "proposal stops at the end of the context"),
    ([7, 8, 9], 3, 1, 4, (), "no earlier occurrence of any suffix"),
    ([5, 1, 9, 2, 1, 9, 3, 2, 1], 2, 1, 4, (9, 3), "longest suffix [2, 1] wins over [1]"),
    ([1, 5, 1, 6, 1], 1, 1, 4, (6,), "the most recent earlier occurrence wins"),
    ([4, 4, 4, 4], 3, 1, 4, (4,), "a run of one token proposes it again"),
    ([1, 2, 9, 1, 2], 3, 3, 4, (), "matches shorter than min_n are not used"),
    ([1, 2, 3, 1, 2], 0, 1, 4, (), "k = 0 proposes nothing"),
    ([3], 4, 1, 4, (), "a single token has no history to match"),
]


@pytest.mark.parametrize("context,k,min_n,max_n,proposal,why", CASES, ids=[c[-1] for c in CASES])
def test_prompt_lookup_proposals(context, k, min_n, max_n, proposal, why):
    assert propose_lookup(context, k, min_n, max_n) == proposal, why


def test_ngram_drafts_are_deterministic_one_hot():
    draft = NgramDrafter().propose([1, 2, 3, 1, 2], 2)
    assert draft.tokens == (3, 1) and draft.probs is None


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramDrafter(min_n=3, max_n=2)
