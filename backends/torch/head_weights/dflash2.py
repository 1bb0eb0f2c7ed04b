"""What DFlash 2 adds to a torch DFlash model: convolutions around each sublayer and the
candidate selector's weights (PyPI dflash 0.1.0, HEADS.md §11.5).

Knows: the tensors DFlash 2 adds and the convolution. Must not know: the checkpoint's files
and config keys (backends/heads/dflash_format.py), the draft layers' attention, the selector's
walk (backends/heads/dflash_drafter.py), the engine's loop.

The convolution is grouped, dynamic, causal and depthwise over the block rows only: row t mixes
rows t, t-1, ..., t-K+1 of the block (zeros before its first row), channel c weighted by
base[o, c] plus a per-row dynamic weight of c's group, itself projected from the sublayer's
normalised input. Before a sublayer it runs with the first kernel pair; the second pair,
projected from the same input, runs on the sublayer's output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from backends.heads.dflash_format import DFlash2Config, module_names

__all__ = ["CandidateSelector", "DFlash2Config", "GroupedCausalConv", "add_dflash2",
           "dflash2_names"]


class GroupedCausalConv(torch.nn.Module):
    """The convolution pair around one sublayer: `prepare` before it, `finish` after."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        groups = hidden // group_size
        self.base_kernel = torch.nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = torch.nn.Linear(hidden, 2 * kernel_size * groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, H] -> (x convolved, the dynamic kernel `finish` uses)."""
        dynamic = self.kernel_projection(x).view(len(x), 2, self.kernel_size, -1)
        return self._convolve(x, dynamic[:, 0], 0), dynamic[:, 1]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, dynamic, 1)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, which: int) -> torch.Tensor:
        # weights[t, o, c] = base[o, c] + dynamic[t, o, c's group]
        weights = self.base_kernel[which].to(x.dtype) + \
            dynamic.repeat_interleave(self.group_size, dim=-1)
        out = torch.zeros_like(x)
        for offset in range(self.kernel_size):  # row t reads row t - offset, zero before 0
            shifted = F.pad(x[:len(x) - offset], (0, 0, offset, 0))
            out = out + weights[:, offset] * shifted
        return out


class CandidateSelector(torch.nn.Module):
    """Scores the top-K candidates of each slot against the token walked to before it."""

    def __init__(self, vocab: int, hidden: int, shape: DFlash2Config) -> None:
        super().__init__()
        self.shape = shape
        self.predecessor_codebook = torch.nn.Parameter(torch.zeros(vocab, shape.rank))
        self.successor_codebook = torch.nn.Parameter(torch.zeros(vocab, shape.rank))
        self.hidden_projection = torch.nn.Linear(hidden, shape.rank, bias=False)


def add_dflash2(model: torch.nn.Module, vocab: int, hidden: int, shape: DFlash2Config) -> None:
    """Give a DFlash model's layers their convolutions and the model its selector."""
    for layer in model.layers:
        layer.attention_conv = GroupedCausalConv(hidden, shape.kernel_size, shape.group_size)
        layer.mlp_conv = GroupedCausalConv(hidden, shape.kernel_size, shape.group_size)
    model.candidate_selector = CandidateSelector(vocab, hidden, shape)


def dflash2_names(state: Mapping[str, Any]) -> dict[str, Any]:
    """Published checkpoints store the codebooks without `.weight`; both spellings load."""
    return module_names(state)
