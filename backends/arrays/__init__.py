"""Arrays: the handful of array operations a drafter written once needs and that torch and
mlx spell differently; each backend has one (backends/torch/arrays.py, backends/mlx/arrays.py).

Knows: the operations, as a protocol. Must not know: an array library (nothing here imports
one), drafting, models. Arrays live on the backend's device; `to_numpy` is the one way back to
the host, so each call of it is a host sync a reader can count. Everything else an array does
alike in both libraries (indexing, slicing, `x[None]`, `+`, `.shape`) is used directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

import numpy as np

Kind = Literal["int", "bool", "float"]


class Arrays(Protocol):
    def context(self) -> AbstractContextManager[Any]:
        """Where drafting runs: no autograd (torch), the target's stream (mlx)."""

    def asarray(self, values: Any, kind: Kind = "int") -> Any:
        """A nested list or numpy array on the device: int64/int32, bool or float32."""

    def arange(self, start: int, stop: int) -> Any:
        """Integers start..stop-1 on the device, made there (no host copy)."""

    def concat(self, parts: Sequence[Any], axis: int = 0) -> Any: ...

    def stack(self, parts: Sequence[Any], axis: int = 0) -> Any: ...

    def argmax(self, x: Any) -> Any:
        """Over the last axis, kept as an axis of length 1."""

    def float32(self, x: Any) -> Any: ...

    def tanh(self, x: Any) -> Any: ...

    def silu(self, x: Any) -> Any: ...

    def softmax(self, x: Any) -> Any:
        """Over the last axis."""

    def log_softmax(self, x: Any) -> Any:
        """Over the last axis."""

    def top_k(self, x: Any, k: int) -> tuple[Any, Any]:
        """(values, indices) of the k largest along the last axis, largest first."""

    def to_numpy(self, x: Any) -> np.ndarray:
        """The array on the host (a sync)."""

    def schedule(self, *xs: Any) -> None:
        """Start computing xs without waiting (lazy libraries); nothing where work is eager."""

    def evaluate(self, *xs: Any) -> None:
        """Compute xs now, so later graphs start from them (lazy libraries)."""
