"""The sampling pipeline: temperature, then top-k, top-p and min-p, as HF's warpers do."""

from __future__ import annotations

import numpy as np
import pytest

from app.core.sampling import sample, warp
from app.core.types import SamplingParams, SpecdeckError

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03]))


def test_greedy_is_the_one_hot_argmax():
    assert warp(LOGITS, SamplingParams()).tolist() == [1, 0, 0, 0, 0]


def test_temperature_one_without_filters_is_the_softmax():
    np.testing.assert_allclose(warp(LOGITS, SamplingParams(temperature=1.0)),
                               [0.5, 0.25, 0.15, 0.07, 0.03], atol=1e-12)


def test_top_k_keeps_the_k_most_likely_tokens():
    probs = warp(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(probs, [2 / 3, 1 / 3, 0, 0, 0], atol=1e-12)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed; the fourth is not
    probs = warp(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(probs, np.array([0.5, 0.25, 0.15, 0, 0]) / 0.9, atol=1e-12)


def test_top_p_always_keeps_the_most_likely_token():
    assert warp(LOGITS, SamplingParams(temperature=1.0, top_p=0.01)).tolist() == [1, 0, 0, 0, 0]


def test_min_p_drops_tokens_below_a_share_of_the_best():
    probs = warp(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))  # keep >= 0.15
    np.testing.assert_allclose(probs, np.array([0.5, 0.25, 0.15, 0, 0]) / 0.9, atol=1e-12)


def test_temperature_is_applied_before_the_filters():
    hot = warp(LOGITS, SamplingParams(temperature=4.0, top_p=0.5))
    cold = warp(LOGITS, SamplingParams(temperature=0.25, top_p=0.5))
    assert (hot > 0).sum() > (cold > 0).sum() == 1


def test_sample_draws_in_proportion():
    rng = np.random.default_rng(0)
    probs = np.array([0.1, 0.0, 0.6, 0.3])
    draws = np.bincount([sample(probs, rng) for _ in range(20_000)], minlength=4) / 20_000
    np.testing.assert_allclose(draws, probs, atol=0.015)
    assert draws[1] == 0


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_k=-1), dict(min_p=1.0), dict(max_new_tokens=0),
                                 dict(temperature=float("nan")), dict(stop=("",))])
def test_invalid_sampling_values_are_refused_with_the_fix(bad):
    with pytest.raises(SpecdeckError) as error:
        SamplingParams(**bad)
    assert "must" in str(error.value)
