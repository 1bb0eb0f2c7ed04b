"""Verification is lossless: committed tokens follow the target's warped distribution exactly."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from app.core.sampling import sample, warp
from app.core.types import Draft, SamplingParams
from app.core.verify import verify_greedy, verify_sampled

V = 6
TRIALS = 30_000

WARPS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05),
]


def logits_table(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Target logits for the first token and, per first token, for the second."""
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1.5, V), rng.normal(0, 1.5, (V, V))


def adversarial_q(p: np.ndarray) -> np.ndarray:
    """A draft that prefers what the target likes least (mass outside the target's support too)."""
    q = np.exp(-4 * p) + 0.01
    return q / q.sum()


def sample_two_tokens(p0: np.ndarray, rows: np.ndarray, deterministic: bool,
                      rng: np.random.Generator) -> tuple[int, int]:
    """One speculative step with k=2, then plain sampling if the step committed one token.

    p0: warped target row for the first token; rows[a]: warped row after token a.
    """
    q0 = adversarial_q(p0)
    d1 = int(np.argmin(p0)) if deterministic else sample(q0, rng)
    q1 = adversarial_q(rows[d1])
    d2 = int(np.argmin(rows[d1])) if deterministic else sample(q1, rng)
    probs = None if deterministic else np.stack([q0, q1])
    verdict = verify_sampled(Draft(tokens=(d1, d2), probs=probs),
                             np.stack([p0, rows[d1], rows[d2]]), rng)
    committed = [d1, d2][:verdict.n_accepted] + [verdict.next_token]
    if len(committed) == 1:
        committed.append(sample(rows[committed[0]], rng))
    return committed[0], committed[1]


def expected_joint(first: np.ndarray, second: np.ndarray, params: SamplingParams) -> np.ndarray:
    p0 = warp(first, params)
    return np.stack([p0[a] * warp(second[a], params) for a in range(V)])  # [V, V]


def warp_id(p: SamplingParams) -> str:
    return f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"


@pytest.mark.parametrize("params", WARPS, ids=warp_id)
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-draft", "one-hot-draft"])
def test_two_token_prefixes_follow_the_target_distribution(params, deterministic):
    first, second = logits_table(seed=3)
    p0, rows = warp(first, params), warp(second, params)
    rng = np.random.default_rng(11)
    counts = np.zeros((V, V))
    for _ in range(TRIALS):
        a, b = sample_two_tokens(p0, rows, deterministic, rng)
        counts[a, b] += 1
    expected = expected_joint(first, second, params).ravel() * TRIALS
    observed = counts.ravel()
    support = expected > 0
    assert support.sum() >= 4, "the warp left too few tokens for the test to mean anything"
    assert observed[~support].sum() == 0, "a token outside the warped support was committed"
    chi2 = stats.chisquare(observed[support], expected[support])
    assert chi2.pvalue > 1e-3, chi2
    tv = 0.5 * np.abs(observed / TRIALS - expected / TRIALS).sum()
    assert tv < 0.03


def test_a_draft_equal_to_the_target_is_always_accepted():
    rng = np.random.default_rng(0)
    p = warp(np.random.default_rng(1).normal(size=(3, V)), SamplingParams(temperature=1.0))
    for _ in range(200):
        tokens = (sample(p[0], rng), sample(p[1], rng))
        verdict = verify_sampled(Draft(tokens=tokens, probs=p[:2]), p, rng)
        assert verdict.n_accepted == 2 and verdict.is_bonus


def test_greedy_accepts_the_matching_prefix_then_emits_the_target_argmax():
    assert verify_greedy(Draft((4, 2, 9)), (4, 2, 7, 1)).n_accepted == 2
    assert verify_greedy(Draft((4, 2, 9)), (4, 2, 7, 1)).next_token == 7
    bonus = verify_greedy(Draft((4, 2)), (4, 2, 5))
    assert (bonus.n_accepted, bonus.next_token, bonus.is_bonus) == (2, 5, True)
    assert verify_greedy(Draft(), (8,)).next_token == 8


def test_draft_probabilities_over_a_padded_vocabulary_are_cut_to_the_target():
    rng = np.random.default_rng(0)
    p = np.array([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    q = np.array([[0.0, 1.0, 0.0, 0.0, 0.0]])  # two padding rows beyond the target's vocabulary
    verdict = verify_sampled(Draft(tokens=(1,), probs=q), p, rng)
    assert verdict.n_accepted == 1


def test_a_token_the_target_filters_out_is_never_accepted():
    params = SamplingParams(temperature=1.0, top_k=2)
    p = warp(np.array([[3.0, 2.0, -1.0, -2.0], [0.0, 0.0, 0.0, 0.0]]), params)
    rng = np.random.default_rng(0)
    for _ in range(500):
        verdict = verify_sampled(Draft(tokens=(3,)), p, rng)
        assert verdict.n_accepted == 0 and verdict.next_token in (0, 1)
