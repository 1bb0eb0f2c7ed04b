"""A mixture-of-experts block's router and experts computing on a GGUF file's blocks.

Knows: what transformers 5's fused experts module computes (Qwen3.5-MoE's and Qwen3-Next's
`*Experts`: each routed row through its experts' gate/up matmul, act(gate) * up, the down
matmul, scaled by its routing weight and summed in expert order) and what their top-k router
computes (softmax over the router's logits, the top k, renormalized where the config says so).
Must not know: files, tensor names, kernels' choice (the layers come built: gguf_model.py
makes one GgufLinear per expert over that expert's contiguous slice of the 3-D tensors).

Why its own modules: transformers' experts multiply by 3-D parameters and its router by a
float32 parameter, and torch's float32 matmul rounds a row differently with the rows beside
it; a GgufLinear gives a row the same bits whatever the rows beside it, so each row's logits,
top-k choice and expert outputs are the ones it gets alone (speculation stays lossless).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.torch.gguf_layers import GgufLinear


class GgufRouter(torch.nn.Module):
    """hidden [rows, d] -> (logits, top-k weights, top-k expert ids), as transformers' top-k
    router returns them, with the logits computed by a GgufLinear over the stored router."""

    def __init__(self, logits: GgufLinear, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.logits = logits
        self.top_k, self.normalize = top_k, normalize

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.logits(hidden.reshape(-1, self.logits.in_features))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts


class GgufExperts(torch.nn.Module):
    """(hidden [rows, d], top-k expert ids, top-k weights) -> [rows, d]: each expert's
    gate/up layer (gate rows first, then up) and down layer on the rows routed to it."""

    def __init__(self, gate_up: list[GgufLinear], down: list[GgufLinear], act: Any) -> None:
        super().__init__()
        if len(gate_up) != len(down):
            raise ValueError("each expert has one gate/up layer and one down layer")
        self.gate_up = torch.nn.ModuleList(gate_up)
        self.down = torch.nn.ModuleList(down)
        self.act_fn = act
        self.num_experts = len(down)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        # ascending expert order, as transformers sums: a row's sum is then the same whatever
        # other rows route where
        for expert in torch.unique(top_k_index).tolist():
            if not 0 <= expert < self.num_experts:
                continue  # transformers' padding index routes nowhere
            rows, slot = torch.where(top_k_index == expert)
            gate, up = self.gate_up[expert](hidden[rows]).chunk(2, dim=-1)
            routed = self.down[expert](self.act_fn(gate) * up)
            routed = routed * top_k_weights[rows, slot, None]
            out.index_add_(0, rows, routed.to(out.dtype))
        return out
