"""Parametrize values that only the full suite runs: `make check` keeps a representative of a
sweep and deselects the rest by the `heavy` marker; `make test` (CI) runs every value."""

from __future__ import annotations

import pytest


def heavy(*values: object) -> list:
    """values as params marked heavy, ids unchanged: a tuple is one row of a multi-name
    parametrize, a pytest.param keeps its own marks (a skipif, say) beside heavy."""
    rows = []
    for value in values:
        if hasattr(value, "values") and hasattr(value, "marks"):  # pytest.param(...)
            rows.append(pytest.param(*value.values, marks=[*value.marks, pytest.mark.heavy],
                                     id=value.id))
        elif isinstance(value, tuple):
            rows.append(pytest.param(*value, marks=pytest.mark.heavy))
        else:
            rows.append(pytest.param(value, marks=pytest.mark.heavy))
    return rows
