"""What DFlash 2 adds to a DFlash block drafter: convolutions around each sublayer and a
candidate selector that walks the target head's top-K (PyPI dflash 0.1.0, HEADS.md §11.5).

Knows: the DFlash 2 config keys (`dflash_config.{conv_kernel_size, conv_group_size,
selector_rank, selector_top_k}`, optional `output_multiplier`, `final_logit_softcapping`), the
tensors they add and the two computations. Must not know: the checkpoint's files, the draft
layers' attention, the engine's loop.

The convolution is grouped, dynamic, causal and depthwise over the block rows only: row t mixes
rows t, t-1, ..., t-K+1 of the block (zeros before its first row), channel c weighted by
base[o, c] plus a per-row dynamic weight of c's group, itself projected from the sublayer's
normalised input. Before a sublayer it runs with the first kernel pair; the second pair,
projected from the same input, runs on the sublayer's output.

The selector scores slot j's K candidates as unary logit + <A[previous] * P h_j, B[candidate]>,
previous being the anchor for slot 0, then the candidate walked to: argmax when greedy, else a
draw from softmax(scores / T), whose row over the vocabulary (zeros off the candidates) is the
q the engine's rejection test needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from app.core.sampling import sample
from app.core.types import SamplingParams

CONFIG_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DFlash2Config:
    """The DFlash 2 shape: convolution kernel and group, selector rank and candidates."""

    kernel_size: int
    group_size: int
    rank: int
    top_k: int
    output_multiplier: float = 1.0
    softcap: float = 0.0

    @classmethod
    def read(cls, value: Any) -> DFlash2Config:
        """From a `key -> dflash_config or top-level value` lookup; KeyError names a key
        that is absent."""
        missing = [key for key in CONFIG_KEYS if value(key) is None]
        if missing:
            raise KeyError(", ".join(missing))
        return cls(int(value("conv_kernel_size")), int(value("conv_group_size")),
                   int(value("selector_rank")), int(value("selector_top_k")),
                   float(value("output_multiplier") or 1.0),
                   float(value("final_logit_softcapping") or 0.0))


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

    def shaped(self, logits: torch.Tensor) -> torch.Tensor:
        """The target head's logits as the drafter was trained on them."""
        logits = logits * self.shape.output_multiplier
        cap = self.shape.softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int,
             params: SamplingParams, rng: np.random.Generator
             ) -> tuple[tuple[int, ...], np.ndarray | None]:
        """hidden [k, H] and logits [k, V] of the draft slots -> the k tokens walked and, when
        sampling, q [k, V] (each row given the tokens before it); None when greedy."""
        unary, candidates = torch.topk(self.shaped(logits), min(self.shape.top_k,
                                                                logits.shape[-1]), dim=-1)
        projected = self.hidden_projection(hidden)
        successors = self.successor_codebook[candidates]  # [k, K, r]
        previous, tokens, rows = anchor, [], []
        for slot in range(len(hidden)):
            query = self.predecessor_codebook[previous] * projected[slot]
            scores = unary[slot] + successors[slot] @ query
            index, row = self._choose(scores, candidates[slot], logits.shape[-1], params, rng)
            previous = int(candidates[slot, index])
            tokens.append(previous)
            rows.append(row)
        return tuple(tokens), None if params.greedy else np.stack(rows)

    @staticmethod
    def _choose(scores: torch.Tensor, candidates: torch.Tensor, vocab: int,
                params: SamplingParams, rng: np.random.Generator
                ) -> tuple[int, np.ndarray | None]:
        if params.greedy:
            return int(scores.argmax()), None
        x = scores.double().cpu().numpy() / params.temperature
        q = np.exp(x - x.max())
        q /= q.sum()
        index = sample(q, rng)
        row = np.zeros(vocab)
        row[candidates.cpu().numpy()] = q
        return index, row


def add_dflash2(model: torch.nn.Module, vocab: int, hidden: int, shape: DFlash2Config) -> None:
    """Give a DFlash model's layers their convolutions and the model its selector."""
    for layer in model.layers:
        layer.attention_conv = GroupedCausalConv(hidden, shape.kernel_size, shape.group_size)
        layer.mlp_conv = GroupedCausalConv(hidden, shape.kernel_size, shape.group_size)
    model.candidate_selector = CandidateSelector(vocab, hidden, shape)


def dflash2_names(state: Mapping[str, Any]) -> dict[str, Any]:
    """Published checkpoints store the codebooks without `.weight`; both spellings load."""
    return {key.removesuffix(".weight") if key.endswith("_codebook.weight") else key: value
            for key, value in state.items()}
