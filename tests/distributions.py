"""The χ² claim the sampled-speculation tests share: committed tokens follow the target."""

from __future__ import annotations

import numpy as np
from scipy import stats

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
