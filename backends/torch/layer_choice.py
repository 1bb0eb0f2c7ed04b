"""Which quantized layer each linear layer of a model becomes under a dtype.

Knows: the layer kinds of quantized_linear.py and w4a8.py, and which of them the output layer
may take.
Must not know: models' architectures, sessions, drafting rules.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.torch.quantized_linear import Int4Linear, Int8Linear, W8A8Linear, w8a8_is_exact
from backends.torch.w4a8 import W4A8Linear


def quantize_linears(hf: Any, kind: str) -> None:
    """Swap every nn.Linear (the output layer included) for a quantized layer of kind, in place.

    int4 quantizes the layers' projections; the output layer keeps 8 bits (w8a8 where exact,
    else weight-only int8), as llama.cpp's Q4_K_M keeps Q6_K there: its logits pick the token.
    """
    head = hf.get_output_embeddings()
    for module in list(hf.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, quantize_linear(child, kind, is_head=child is head))
    hf.to(torch.bfloat16)


def quantize_linear(linear: torch.nn.Linear, kind: str, is_head: bool) -> torch.nn.Module:
    """One linear layer in kind's quantization (the output layer keeps 8 bits under int4 and
    w4a8)."""
    if kind == "w4a8" and not is_head:
        if W4A8Linear.can_take(linear):
            return W4A8Linear.quantize(linear)
    if kind == "int4" and not is_head and Int4Linear.can_take(linear):
        return Int4Linear.quantize(linear)
    if kind == "int8" or not w8a8_is_exact():
        return Int8Linear.quantize(linear)
    # float32 logits: torch's argmax over 151,936 bf16 logits took 0.8 ms a row, over float32
    # 0.1 ms (2-core EPYC), and sampling reads float32 anyway
    return W8A8Linear.quantize(linear, keep_int8=is_head,
                               out_dtype=torch.float32 if is_head else torch.bfloat16)
