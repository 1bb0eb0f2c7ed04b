"""TorchArrays: backends/arrays' operations on torch tensors of one device.

Knows: torch. Must not know: drafting, models. torch runs eagerly: schedule and evaluate do
nothing, and only to_numpy waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from backends.arrays import Kind

_DTYPES = {"int": torch.long, "bool": torch.bool, "float": torch.float32}


class TorchArrays:
    def __init__(self, device: Any) -> None:
        self.device = device

    def context(self) -> AbstractContextManager[Any]:
        return torch.inference_mode()

    def asarray(self, values: Any, kind: Kind = "int") -> torch.Tensor:
        return torch.as_tensor(values, dtype=_DTYPES[kind], device=self.device)

    def arange(self, start: int, stop: int) -> torch.Tensor:
        return torch.arange(start, stop, device=self.device)

    def concat(self, parts: Sequence[torch.Tensor], axis: int = 0) -> torch.Tensor:
        return torch.cat(list(parts), dim=axis)

    def stack(self, parts: Sequence[torch.Tensor], axis: int = 0) -> torch.Tensor:
        return torch.stack(list(parts), dim=axis)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1, keepdim=True)

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()

    def tanh(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=-1)

    def top_k(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x.topk(k)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().cpu().numpy()

    def schedule(self, *xs: Any) -> None:
        return None

    def evaluate(self, *xs: Any) -> None:
        return None
