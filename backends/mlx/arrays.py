"""MlxArrays: backends/arrays' operations on mlx arrays, on one stream.

Knows: mlx.core. Must not know: drafting, models. mlx is lazy: schedule starts a graph
(mx.async_eval), evaluate computes it (mx.eval), to_numpy reads it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx
import numpy as np

from backends.arrays import Kind

_DTYPES = {"int": mx.int32, "bool": mx.bool_, "float": mx.float32}


class MlxArrays:
    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def context(self) -> AbstractContextManager[Any]:
        return mx.stream(self.stream)

    def asarray(self, values: Any, kind: Kind = "int") -> mx.array:
        return mx.array(values, dtype=_DTYPES[kind])

    def arange(self, start: int, stop: int) -> mx.array:
        return mx.arange(start, stop)

    def concat(self, parts: Sequence[mx.array], axis: int = 0) -> mx.array:
        return mx.concatenate(list(parts), axis=axis)

    def stack(self, parts: Sequence[mx.array], axis: int = 0) -> mx.array:
        return mx.stack(list(parts), axis=axis)

    def argmax(self, x: mx.array) -> mx.array:
        return mx.argmax(x, axis=-1, keepdims=True)

    def float32(self, x: mx.array) -> mx.array:
        return x.astype(mx.float32)

    def tanh(self, x: mx.array) -> mx.array:
        return mx.tanh(x)

    def silu(self, x: mx.array) -> mx.array:
        return x * mx.sigmoid(x)

    def softmax(self, x: mx.array) -> mx.array:
        return mx.softmax(x, axis=-1)

    def log_softmax(self, x: mx.array) -> mx.array:
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    def top_k(self, x: mx.array, k: int) -> tuple[mx.array, mx.array]:
        # mx.topk gives values only, unordered: partition for the k, then order those k
        index = mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k]
        values = mx.take_along_axis(x, index, axis=-1)
        order = mx.argsort(-values, axis=-1)
        return mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(index, order, -1)

    def to_numpy(self, x: mx.array) -> np.ndarray:
        return np.array(x)

    def schedule(self, *xs: Any) -> None:
        mx.async_eval(*xs)

    def evaluate(self, *xs: Any) -> None:
        mx.eval(*xs)
