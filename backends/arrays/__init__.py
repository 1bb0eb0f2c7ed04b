"""Arrays: the few array operations that differ between torch and mlx, so that drafting logic
(backends/heads/) is written once and runs over either backend's arrays.

Knows: the names and meanings of those operations. Must not know: any array library (the
implementations are backends/torch/arrays.py and backends/mlx/arrays.py), drafters, models.
What both libraries already spell alike (slicing, integer and array indexing, `*`, `+`, `@`,
`.shape`) is used directly and has no method here.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol


class Arrays(Protocol):
    """One backend's arrays, on the device its model runs on."""

    def scope(self) -> AbstractContextManager[Any]:
        """Where drafting runs: torch without autograd, mlx on the model's stream."""
        ...

    def asarray(self, values: Sequence[int]) -> Any:
        """Token ids as an integer array on the device."""
        ...

    def concat(self, arrays: Sequence[Any], axis: int = 0) -> Any: ...

    def stack(self, arrays: Sequence[Any], axis: int = 0) -> Any: ...

    def argmax(self, x: Any, axis: int = -1) -> Any: ...

    def topk(self, x: Any, k: int) -> tuple[Any, Any]:
        """The k largest values along the last axis, largest first, and their indices."""
        ...

    def tanh(self, x: Any) -> Any: ...

    def to_numpy(self, x: Any) -> Any:
        """x on the host as a numpy array (a host sync)."""
        ...
