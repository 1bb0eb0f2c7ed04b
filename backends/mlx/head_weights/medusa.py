"""Medusa heads on MLX: the weight module, and the drafter (backends/heads/medusa_drafter.py)
built on it from the same folders torch loads.

Knows: the heads as mlx.nn linear layers, mx.load of the tensors the folder's spec names (lazy:
of a Medusa-2 full model only the heads are read), the parts an mlx-lm target lends a head
(backends/mlx/head_weights/eagle.py `target_parts`). Must not know: the folder's format
(backends/heads/medusa_format.py), the head math and drafting
(backends/heads/medusa_drafter.py), the engine's loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from backends.heads.medusa_drafter import MedusaDrafter
from backends.heads.medusa_format import read_medusa
from backends.mlx.arrays import MlxArrays
from backends.mlx.head_weights.eagle import target_parts


class MedusaHeads(nn.Module):
    """n heads, each one ResBlock linear layer (applied `n_layers` times) and a vocabulary
    projection."""

    def __init__(self, n_heads: int, n_layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.n_heads, self.n_layers = n_heads, n_layers
        self.blocks = [nn.Linear(hidden, hidden) for _ in range(n_heads)]
        self.heads = [nn.Linear(hidden, vocab, bias=False) for _ in range(n_heads)]


def load_medusa_drafter(target: Any, path: str,
                        choices: Sequence[tuple[int, ...]] | None = None) -> MedusaDrafter:
    """The drafter for the MLX `target` from a Medusa head folder (choices: the static tree,
    else the default one)."""
    _, norm, _ = target_parts(target.net, target.name)
    hidden = int(norm.weight.shape[-1])  # a norm is never quantized
    spec = read_medusa(path, hidden=hidden, vocab=target.vocab_size)
    files = {file: mx.load(str(file)) for _, file, _ in spec.sources}
    heads = MedusaHeads(spec.n_heads, spec.n_layers, hidden, target.vocab_size)
    heads.load_weights([(ours, files[file][stored]) for ours, file, stored in spec.sources])
    heads.set_dtype(target.compute_dtype)
    mx.eval(heads.parameters())
    return MedusaDrafter(heads, MlxArrays(target.stream), norm, target.n_layers, choices)
