"""DSpark block drafters on torch: the weight modules, and the drafter
(backends/heads/dspark_drafter.py) built on them from a folder.

Knows: the Markov and confidence heads as torch modules beside DFlash's layers
(backends/torch/head_weights/dflash.py), torch's safetensors loading. Must not know: the folder's
format (backends/heads/dspark_format.py), drafting (the walk, the cut:
backends/heads/dspark_drafter.py), surfaces, the engine's loop. Only DeepSpec's `vanilla`
Markov head runs; the format refuses `gated` and `rnn` by name.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3Config

from app.core.types import SpecdeckError
from backends.heads.dspark_drafter import DSparkDrafter
from backends.heads.dspark_format import (
    DSparkShape,
    DSparkSpec,
    check_tensors,
    read_dspark,
    stored_names,
)
from backends.torch.arrays import TorchArrays
from backends.torch.head_weights.dflash import DFlashModel


class MarkovHead(torch.nn.Module):
    """The vanilla head: a [V, r] embedding of the previous token and an r -> V projection."""

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = torch.nn.Embedding(vocab, rank)
        self.markov_w2 = torch.nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(torch.nn.Module):
    """Linear [h; markov_w1[previous]] (or h) -> one logit."""

    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(inputs, 1)


class DSparkModel(DFlashModel):
    """DFlash's layers, fusion and norms, with the Markov and confidence heads."""

    def __init__(self, config: Qwen3Config, shape: DSparkShape) -> None:
        super().__init__(config, len(shape.layer_ids))
        rank = shape.markov_rank
        self.markov_head = MarkovHead(config.vocab_size, rank) if rank else None
        inputs = config.hidden_size + (rank if shape.confidence_with_markov else 0)
        self.confidence_head = ConfidenceHead(inputs) if shape.confidence else None


def load_dspark_drafter(target: Any, path: str, threshold: float = 0.0) -> DSparkDrafter:
    """A DSpark drafter folder (DeepSpec or speculators layout), checked against the torch
    target; threshold: the confidence below which a block stops (0: never)."""
    output = target.hf.get_output_embeddings()
    spec = read_dspark(path, hidden_size=int(target.hf.config.get_text_config().hidden_size),
                       vocab_size=target.vocab_size, n_layers=target.n_layers,
                       head_rows=int(output.weight.shape[0]))
    model = DSparkModel(Qwen3Config(**spec.layers.config), spec.shape)
    _load_weights(spec, model)
    model = model.to(device=target.device, dtype=target.hf.dtype).eval()
    embed = target.hf.get_input_embeddings()
    return DSparkDrafter(model, TorchArrays(embed.weight.device), spec.shape, embed=embed,
                         lm_head=output, threshold=threshold)


def _load_weights(spec: DSparkSpec, model: DSparkModel) -> None:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in spec.layers.weights:
        state.update(load_file(str(file)))
    try:
        missing, unexpected = model.load_state_dict(stored_names(state), strict=False)
    except RuntimeError as error:  # a tensor of another shape than the config describes
        raise SpecdeckError(f"{spec.folder}: its tensors do not match its config: "
                            f"{str(error).splitlines()[-1].strip()}") from error
    check_tensors(spec, [m for m in missing if not m.startswith("rotary.")], unexpected)
