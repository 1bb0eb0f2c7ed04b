"""DSpark block drafters on MLX: the weight modules, and the drafter
(backends/heads/dspark_drafter.py) built on them from the same folders torch loads.

Knows: the Markov and confidence heads as mlx modules beside DFlash's layers
(backends/mlx/head_weights/dflash.py; the math of backends/torch/head_weights/dspark.py), mx.load of
safetensors. Must not know: the folder's format (backends/heads/dspark_format.py), drafting
(the walk, the cut: backends/heads/dspark_drafter.py), the engine's loop.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from app.core.types import SpecdeckError
from backends.heads.dspark_drafter import DSparkDrafter
from backends.heads.dspark_format import (
    DSparkShape,
    DSparkSpec,
    check_tensors,
    read_dspark,
    stored_names,
)
from backends.mlx.arrays import MlxArrays
from backends.mlx.head_weights.dflash import DFlashModel, load_checked
from backends.mlx.head_weights.eagle import target_parts


class MarkovHead(nn.Module):
    """The vanilla head: a [V, r] embedding of the previous token and an r -> V projection."""

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    """Linear [h; markov_w1[previous]] (or h) -> one logit."""

    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.proj = nn.Linear(inputs, 1)


class DSparkModel(DFlashModel):
    """DFlash's layers, fusion and norms, with the Markov and confidence heads (each absent
    where the checkpoint has none)."""

    def __init__(self, spec: DSparkSpec) -> None:
        super().__init__(spec.layers)
        shape: DSparkShape = spec.shape
        if shape.markov_rank:
            self.markov_head = MarkovHead(int(spec.layers.get("vocab_size")), shape.markov_rank)
        if shape.confidence:
            inputs = spec.layers.hidden_size + \
                (shape.markov_rank if shape.confidence_with_markov else 0)
            self.confidence_head = ConfidenceHead(inputs)


def load_dspark_drafter(target: Any, path: str, threshold: float = 0.0) -> DSparkDrafter:
    """A DSpark drafter folder (DeepSpec or speculators layout), checked against the MLX
    target; threshold: the confidence below which a block stops (0: never)."""
    embed, final_norm, output = target_parts(target.net, target.name)
    spec = read_dspark(path, hidden_size=int(final_norm.weight.shape[-1]),
                       vocab_size=target.vocab_size, n_layers=target.n_layers,
                       head_rows=target.vocab_size)
    if spec.layers.get("hidden_act", "silu") != "silu":
        raise SpecdeckError(f"{spec.folder} uses {spec.layers.get('hidden_act')!r}; the MLX "
                            "DSpark drafter runs silu layers: use --backend torch")
    model = DSparkModel(spec)
    _load_weights(spec, model, target.compute_dtype)
    return DSparkDrafter(model, MlxArrays(target.stream), spec.shape, embed=embed,
                         lm_head=output, threshold=threshold)


def _load_weights(spec: DSparkSpec, model: DSparkModel, dtype: mx.Dtype) -> None:
    load_checked(spec.layers.weights, model, stored_names,
                 lambda missing, extra: check_tensors(spec, missing, extra), spec.folder, dtype)
