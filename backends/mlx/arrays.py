"""Arrays (backends/arrays) over mlx arrays on one stream.

Knows: mlx. Must not know: drafters or models.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx
import numpy as np


class MlxArrays:
    """The Arrays operations on mlx arrays; work is queued on `stream` (a device or stream)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def scope(self) -> AbstractContextManager[Any]:
        return mx.stream(self.stream)

    def asarray(self, values: Sequence[int]) -> mx.array:
        return mx.array(list(values))

    def concat(self, arrays: Sequence[mx.array], axis: int = 0) -> mx.array:
        return mx.concatenate(list(arrays), axis=axis)

    def stack(self, arrays: Sequence[mx.array], axis: int = 0) -> mx.array:
        return mx.stack(list(arrays), axis=axis)

    def argmax(self, x: mx.array, axis: int = -1) -> mx.array:
        return mx.argmax(x, axis=axis)

    def topk(self, x: mx.array, k: int) -> tuple[mx.array, mx.array]:
        # mx.topk leaves its k unordered: order them as torch.topk does (a sampled walk's
        # draw reads q in this order, so both backends draw the same index)
        part = mx.argpartition(-x, k - 1, axis=-1)[..., :k]
        values = mx.take_along_axis(x, part, axis=-1)
        order = mx.argsort(-values, axis=-1)
        return mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(part, order,
                                                                               axis=-1)

    def tanh(self, x: mx.array) -> mx.array:
        return mx.tanh(x)

    def to_numpy(self, x: mx.array) -> np.ndarray:
        return np.array(x)
