"""Output layers of a drafter session's own: a vocabulary subset and the 4-bit drafting head.

Knows: torch modules, the quantized layers' row slicing (quantized_linear.py) and the w4a8 kernel's
layer, which transformers configs compute logits as the output layer's product alone. Must
not know: sessions, caches, drafting rules. Each layer here is built from a model's output
layer and never replaces it: the target, other drafters and plain sessions may share that
model object.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from backends.torch import w4a8
from backends.torch.gguf_layers import GgufLinear, Part
from backends.torch.quantized_linear import Int8Linear, W8A8Linear, quantize_weight_int4

# config fields of models whose logits are scaled or capped after the output layer (Gemma's
# softcapping, Cohere's and Granite's scales): a head of a session's own would skip that step
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class SubsetHead(torch.nn.Module):
    """An output layer over a subset of the vocabulary, scattered into full-width logits."""

    def __init__(self, head: torch.nn.Module, token_ids: Sequence[int], vocab_size: int) -> None:
        super().__init__()
        ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
        self.register_buffer("ids", ids)
        self.vocab_size = vocab_size
        self.sub: torch.nn.Module
        if isinstance(head, (Int8Linear, W8A8Linear, GgufLinear)):
            self.sub = head.rows(ids)
        else:
            self.sub = torch.nn.Linear(head.in_features, len(ids), bias=head.bias is not None,
                                       device=head.weight.device, dtype=head.weight.dtype)
            with torch.no_grad():
                self.sub.weight.copy_(head.weight[ids])
                if head.bias is not None:
                    self.sub.bias.copy_(head.bias[ids])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.sub(x)
        full = part.new_full((*part.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids.to(part.device), part)


def light_head(head: torch.nn.Module, dtype: str) -> torch.nn.Module | None:
    """A 4-bit copy of a w4a8 or gguf model's output layer, or None where there is none to
    make.

    Drafts are proposals the target checks, so their logits need no source precision; the
    0.5B Qwen's output layer (136M weights) cost a draft token 17.3 ms with 8 bits and 15.0
    ms with 4 (2-core EPYC, interleaved). Its file stores that layer as Q8_0."""
    if dtype == "w4a8" and isinstance(head, W8A8Linear) and head.weight_int8 is not None:
        chunks = _w8a8_rows(head)
    elif dtype == "gguf" and isinstance(head, GgufLinear) and len(head.parts) == 1:
        chunks = _gguf_rows(head.parts[0])
    else:
        return None
    if not w4a8.is_available() or head.in_features % w4a8.GROUP or \
            head.out_features % w4a8.TILE:
        return None
    # quantized and packed a block of rows at a time, straight into the layer's buffer: the
    # float copy of a 151,936-row layer at once would add half a gigabyte to the peak memory
    # of loading, and its unpacked codes 136 MB (which glibc kept after they were freed)
    packed = None
    for start, weight in zip(range(0, head.out_features, _ROWS), chunks, strict=True):
        if weight is None:
            return None
        code, table = quantize_weight_int4(weight, w4a8.GROUP)
        block = w4a8.pack(code, table)
        if packed is None:
            per_row = block.numel() // len(weight)
            packed = torch.empty(head.out_features * per_row, dtype=torch.uint8)
        packed[start * per_row:start * per_row + block.numel()] = block
    light = w4a8.W4A8Linear(packed, head.out_features, head.in_features, None)
    light.bias, light.float_out = getattr(head, "bias", None), True
    return light


_ROWS = 2048  # output rows quantized at a time (a multiple of w4a8's 16-row tiles)


def _w8a8_rows(head: W8A8Linear) -> Iterator[torch.Tensor]:
    for start in range(0, head.out_features, _ROWS):
        rows = slice(start, start + _ROWS)
        yield head.weight_int8[rows].float() * head.scales[rows, None]


def _gguf_rows(part: Part) -> Iterator[torch.Tensor | None]:
    for start in range(0, part.out_features, _ROWS):
        yield part.float_rows(start, min(start + _ROWS, part.out_features))


def logits_are_the_head_alone(config: Any) -> bool:
    """Whether the model's logits are its output layer applied to its last hidden state, so a
    head of a session's own computes the logits the model would."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return not any(getattr(text, name, None) for name in LOGIT_TRANSFORMS)
