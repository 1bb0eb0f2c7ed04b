"""Fused projections: q/k/v (and gate/up) computed by one matmul over weights concatenated once
at load, each original projection answering with its slice of the result.

Knows: torch modules, the attribute names transformers' Llama-style layers give their
projections. Must not know: sessions, quantization (the fused layer is a plain nn.Linear, so
quantized_linear.py quantizes it like any other: per output channel or per group of inputs,
which gives every output the codes and scales it had unfused), drafting.

Why: at one row per forward a small drafter spends much of its time launching ops, and three
projections of the same input are three matmuls, three bias adds and (w8a8) three rescales.
Row invariance is the fused layer's own: the load-time check (exactness.py) checks it, since
the fused layer is one of the model's linear layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (fused layer's name, projections that read the same input, in the order transformers'
# layers call them)
GROUPS = (("qkv_fused", ("q_proj", "k_proj", "v_proj")),
          ("gate_up_fused", ("gate_proj", "up_proj")))
# where v_proj is None, not absent: Gemma 4's attention_k_eq_v full layers take their values
# from the keys' projection, so their queries and keys are the projections of one input
KEYS_AS_VALUES = ("qk_fused", ("q_proj", "k_proj"))


class FusedProjection(torch.nn.Module):
    """One layer for several projections of one input; remembers its last result until the
    last projection has read it."""

    def __init__(self, layer: torch.nn.Module, sizes: Sequence[int]) -> None:
        super().__init__()
        self.layer = layer
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = list(sizes)
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        # the first projection always computes: an input tensor is never trusted across calls
        if index == 0 or self._input is not x or self._output is None:
            self._input, self._output = x, self.layer(x)
        out = self._output
        if index == len(self.sizes) - 1:
            self._input = self._output = None
        return out.narrow(-1, self.starts[index], self.sizes[index])


class ProjectionSlice(torch.nn.Module):
    """Stands where one of the fused projections stood."""

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        # not a submodule: the fused layer belongs to the parent once, not to every slice
        object.__setattr__(self, "fused", fused)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse every group of GROUPS found as nn.Linear children of one module; returns how many
    groups were fused. Run before quantizing."""
    fused = 0
    for module in list(model.modules()):
        for fused_name, names in _groups(module):
            layers = [getattr(module, name, None) for name in names]
            if not _fusable(layers):
                continue
            group = FusedProjection(_concatenated(layers), [lin.out_features for lin in layers])
            module.add_module(fused_name, group)
            for index, name in enumerate(names):
                setattr(module, name, ProjectionSlice(group, index))
            fused += 1
    return fused


def _groups(module: torch.nn.Module) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """GROUPS, and KEYS_AS_VALUES for a module whose v_proj is None."""
    if hasattr(module, "v_proj") and module.v_proj is None:
        return (*GROUPS, KEYS_AS_VALUES)
    return GROUPS


def _fusable(layers: list[torch.nn.Module | None]) -> bool:
    linears = [lin for lin in layers if type(lin) is torch.nn.Linear]
    kinds = {(lin.in_features, lin.weight.dtype, lin.weight.device, lin.bias is None)
             for lin in linears}
    return len(linears) == len(layers) and len(kinds) == 1


def _concatenated(layers: list[torch.nn.Linear]) -> torch.nn.Linear:
    first = layers[0]
    out = torch.nn.Linear(first.in_features, sum(lin.out_features for lin in layers),
                          bias=first.bias is not None, device=first.weight.device,
                          dtype=first.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([lin.weight for lin in layers]))
        if first.bias is not None:
            out.bias.copy_(torch.cat([lin.bias for lin in layers]))
    return out
