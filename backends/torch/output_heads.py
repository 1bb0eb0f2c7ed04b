"""Output layers of a drafter session's own: a vocabulary subset and the 4-bit drafting head.

Knows: torch modules, the quantized layers' row slicing (quant.py) and the w4a8 kernel's
layer, which transformers configs compute logits as the output layer's product alone. Must
not know: sessions, caches, drafting rules. Each layer here is built from a model's output
layer and never replaces it: the target, other drafters and plain sessions may share that
model object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from backends.torch import w4a8
from backends.torch.gguf_layers import GgufLinear
from backends.torch.quant import Int8Linear, W8A8Linear

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
    """A 4-bit copy of a w4a8 model's 8-bit output layer, or None where there is none to make.

    Drafts are proposals the target checks, so their logits need no source precision; the
    0.5B Qwen's output layer (136M weights) cost a draft token 17.3 ms with 8 bits and 15.0
    ms with 4 (2-core EPYC, interleaved)."""
    if dtype != "w4a8" or not isinstance(head, W8A8Linear) or head.weight_int8 is None:
        return None
    linear = torch.nn.Linear(head.in_features, head.out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(head.weight_int8.float() * head.scales[:, None])
    if not w4a8.W4A8Linear.can_take(linear):
        return None
    light = w4a8.W4A8Linear.quantize(linear, prefill=False)
    light.bias, light.float_out = head.bias, True
    return light


def logits_are_the_head_alone(config: Any) -> bool:
    """Whether the model's logits are its output layer applied to its last hidden state, so a
    head of a session's own computes the logits the model would."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return not any(getattr(text, name, None) for name in LOGIT_TRANSFORMS)
