"""The χ² claim the sampled-speculation tests share: committed tokens follow the target."""

from __future__ import annotations

import numpy as np
from scipy import stats

from app.core.sampling import warp

MIN_EXPECTED = 5  # cells expected fewer times are left out, as χ² needs
P_VALUE = 1e-3


def assert_follows(observed: np.ndarray, expected: np.ndarray) -> None:
    """Counts of committed outcomes against expected counts (any shape): χ² p-value above
    P_VALUE over the cells expected at least MIN_EXPECTED times, rescaled to their total."""
    observed, expected = np.ravel(observed), np.ravel(expected)
    keep = expected > MIN_EXPECTED
    _, pvalue = stats.chisquare(observed[keep], expected[keep] * observed[keep].sum()
                                / expected[keep].sum())
    assert pvalue > P_VALUE, pvalue


def assert_first_two_follow(target, drafter, prompt: list[int], vocab: int, n: int) -> None:
    """Speculative sampling (temperature 1, k = 2, three tokens) over n seeds: the drafter
    drafted, and the first two committed tokens follow plain sampling's law (the second is
    verified against the first step's draft; the third ends the generation)."""
    from app.core.engine import SpecEngine
    from app.core.types import SamplingParams

    expected = first_two_law(target, prompt, SamplingParams(temperature=1.0), vocab)
    engine, counts = SpecEngine(target), np.zeros((vocab, vocab))
    for seed in range(n):
        done = list(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3,
                                                           seed=seed), drafter=drafter, k=2))[-1]
        counts[tuple(done.token_ids[:2])] += 1
    assert done.stats.drafted > 0
    assert_follows(counts, expected * n)


def two_token_law(target, prompt: list[int], params, vocab: int) -> np.ndarray:
    """p(second, third token) of plain sampled decoding, from the target's own rows (the
    step after the prefill's token drafts both)."""
    session = target.start()

    def law(ids: list[int]) -> np.ndarray:
        session.rewind(0)
        row = session.forward(ids, n_logits=1).host_logits()[-1].astype(np.float64)
        return warp(row, params)

    first = law(prompt)
    joint = np.zeros((vocab, vocab))
    for a in range(vocab):
        second = law(prompt + [a])
        for b in range(vocab):
            joint[b] += first[a] * second[b] * law(prompt + [a, b])
    return joint


def first_two_law(target, prompt: list[int], params, vocab: int) -> np.ndarray:
    """p(first, second token) of plain sampled decoding after prompt, from the target's rows."""
    session = target.start()
    first = warp(session.forward(prompt).host_logits()[-1].astype(np.float64), params)
    joint = np.zeros((vocab, vocab))
    for a in range(vocab):
        joint[a] = first[a] * warp(session.forward([a]).host_logits()[-1].astype(np.float64),
                                   params)
        session.rewind(len(prompt))
    return joint


def second_token_law(target, prompt: list[int]) -> np.ndarray:
    """p(second token) of plain sampled decoding at temperature 1 after prompt: the first is
    sampled at the prefill, the second is the first a verify decides."""
    from app.core.types import SamplingParams

    return first_two_law(target, prompt, SamplingParams(temperature=1.0),
                         target.vocab_size).sum(axis=0)


def second_tokens(target, prompt: list[int], drafter, n: int, k: int = 2) -> np.ndarray:
    """Counts of the second committed token over n sampled generations (seeds 0..n-1) at
    temperature 1 with the drafter; the drafter must have drafted."""
    from app.core.engine import SpecEngine
    from app.core.types import SamplingParams

    engine, counts = SpecEngine(target), np.zeros(target.vocab_size)
    for seed in range(n):
        done = list(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3,
                                                           seed=seed), drafter=drafter, k=k))[-1]
        counts[done.token_ids[1]] += 1
    assert done.stats.drafted > 0
    return counts
