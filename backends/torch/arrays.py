"""Arrays (backends/arrays) over torch tensors on one device.

Knows: torch. Must not know: drafters or models.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch


class TorchArrays:
    """The Arrays operations on torch tensors; new tensors go to `device`."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def scope(self) -> AbstractContextManager[Any]:
        return torch.inference_mode()

    def asarray(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), device=self.device)

    def concat(self, arrays: Sequence[torch.Tensor], axis: int = 0) -> torch.Tensor:
        return torch.cat(list(arrays), dim=axis)

    def stack(self, arrays: Sequence[torch.Tensor], axis: int = 0) -> torch.Tensor:
        return torch.stack(list(arrays), dim=axis)

    def argmax(self, x: torch.Tensor, axis: int = -1) -> torch.Tensor:
        return x.argmax(dim=axis)

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.topk(x, k, dim=-1)
        return values, indices

    def tanh(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().cpu().numpy()
