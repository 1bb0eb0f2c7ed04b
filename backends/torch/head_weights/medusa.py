"""Medusa heads on torch: the weight module, and the drafter (backends/heads/medusa_drafter.py)
built on it from a folder.

Knows: the heads as torch linear layers, torch's safetensors reading of the tensors the
folder's spec names, where an HF target keeps its final norm. Must not know: the folder's
format (backends/heads/medusa_format.py), the head math and drafting
(backends/heads/medusa_drafter.py), surfaces, the engine's loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from app.core.types import SpecdeckError
from backends.heads.medusa_drafter import MedusaDrafter
from backends.heads.medusa_format import read_medusa
from backends.torch.arrays import TorchArrays


class MedusaHeads(torch.nn.Module):
    """n heads, each one ResBlock linear layer (applied `n_layers` times) and a vocabulary
    projection."""

    def __init__(self, n_heads: int, n_layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.n_heads, self.n_layers = n_heads, n_layers
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(n_heads))
        self.heads = torch.nn.ModuleList(torch.nn.Linear(hidden, vocab, bias=False)
                                         for _ in range(n_heads))


def load_medusa(path: str | Path, hidden: int, vocab: int, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> MedusaHeads:
    """Heads from a folder (or file) with Medusa-1 or Medusa-2 names, checked against the
    target's hidden size and vocabulary; only the head tensors are read."""
    from safetensors import safe_open

    spec = read_medusa(path, hidden=hidden, vocab=vocab)
    state = {}
    for ours, file, stored in spec.sources:
        with safe_open(str(file), framework="pt") as f:
            state[ours] = f.get_tensor(stored)
    heads = MedusaHeads(spec.n_heads, spec.n_layers, hidden, vocab)
    heads.load_state_dict(state)
    return heads.to(device=device, dtype=dtype).eval()


def load_medusa_drafter(target: Any, path: str,
                        choices: Sequence[tuple[int, ...]] | None = None) -> MedusaDrafter:
    """The drafter for `target` from a Medusa head folder (choices: the static tree, else
    the default one)."""
    config = target.hf.config.get_text_config()
    heads = load_medusa(path, int(config.hidden_size), int(target.vocab_size),
                        dtype=target.hf.dtype, device=target.device)
    norm = _final_norm(target)
    dtype = heads.heads[0].weight.dtype
    return MedusaDrafter(heads, TorchArrays(heads.heads[0].weight.device),
                         lambda hidden: norm(hidden.to(dtype)), target.n_layers, choices)


def _final_norm(target: Any) -> torch.nn.Module:
    """The norm the target applies before its output layer (Medusa heads read after it)."""
    norm = getattr(getattr(target.hf, "model", None), "norm", None)
    if norm is None:
        raise SpecdeckError(f"{target.name}: cannot find its final norm (model.norm), which "
                            "Medusa heads read after; use a Llama/Qwen/Mistral-style target")
    return norm
