"""DSpark block drafters (DeepSeek, DeepSpec): a DFlash backbone run once per block, a low-rank
Markov head that makes each draft depend on the one before it, and a confidence head.

Knows: DeepSpec's small-model checkpoint (`Qwen3DSparkModel`: the DFlash-1 names, frozen copies
`embed_tokens` and `lm_head` of the target's, `markov_head.markov_w{1,2}.weight`,
`confidence_head.proj.{weight,bias}`; config `block_size`, `target_layer_ids`, `mask_token_id`,
`markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`) and
speculators' DSpark format (`speculators_model_type: dspark`, `transformer_layer_config`,
`aux_hidden_state_layer_ids` = layer outputs + 1, `sample_from_anchor`, default True); the walk
over a block's rows. Must not know: surfaces, the engine's loop, the k controller.

DeepSpec (`modeling/dspark`, `eval/dspark/draft_ops.py`): the block [anchor, mask x (B-1)]
always has B rows (the drafter was trained on whole blocks, and its rows see each other), and
row j predicts the token at anchor + j + 1, so a block gives B drafts (speculators checkpoints
with sample_from_anchor false: rows 1.. only, as DFlash). Left to right from x_0 = anchor, slot
j's logits are lm_head(h_j) + markov_w2(markov_w1[x_(j-1)]), and x_j their argmax, or a draw
from q = warp(logits) whose rows the engine's rejection test reads. The confidence
c_j = sigmoid(proj([h_j; markov_w1[x_(j-1)]])) depends only on tokens already drafted, so
stopping at the first c_j below a threshold (DeepSpec's rule; 0, its default, never stops)
keeps verification exact. The prefix survival prod c_i goes out with the draft (Draft.survival)
for the k controller. The embedding and output layer used are the target's (the folder's are
copies). Only the `vanilla` Markov head runs; `gated` and `rnn` are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Qwen3Config

from app.core.sampling import sample, warp
from app.core.types import Draft, SpecdeckError
from app.drafters.native import dspark_stages_refusal, has_dspark_stages
from backends.torch.heads.dflash import DFlashDrafter, DFlashModel, check_fit, read_state

DEEPSPEC = "Qwen3DSparkModel"
HEAD_TYPES = ("vanilla",)  # DeepSpec's gated and rnn heads carry more tensors and a state
SHARED = ("embed_tokens.weight", "lm_head.weight")  # copies of the target's


@dataclass(frozen=True)
class DSparkShape:
    """What a DSpark checkpoint declares beside its Qwen3 layers."""

    block_size: int
    mask_token_id: int
    layer_ids: tuple[int, ...]  # target layer OUTPUTS (HF hidden_states[id + 1])
    markov_rank: int
    confidence: bool
    confidence_with_markov: bool
    from_anchor: bool = True  # row j predicts anchor + j + 1 (else anchor + j, row 0 unused)


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


class DSparkDrafter(DFlashDrafter):
    """Drafts up to a block's worth of tokens per step, walking the Markov chain."""

    name = "dspark"

    def __init__(self, target: Any, model: DSparkModel, shape: DSparkShape,
                 threshold: float = 0.0) -> None:
        super().__init__(target, model, shape.layer_ids, shape.block_size, shape.mask_token_id)
        self.shape, self.threshold = shape, threshold

    @property
    def max_drafts(self) -> int:
        return self.block_size if self.shape.from_anchor else self.block_size - 1

    def _rows(self, k: int) -> int:
        return self.block_size  # trained on whole blocks: fewer rows change every row's output

    def _draft(self, out: torch.Tensor, anchor: int, k: int) -> Draft:
        first = 0 if self.shape.from_anchor else 1
        hidden = out[first:first + k]
        return self._walk(hidden, self.lm_head(hidden), anchor)

    def _walk(self, hidden: torch.Tensor, base: torch.Tensor, anchor: int) -> Draft:
        """Slot by slot from the anchor: stop where the confidence falls below the threshold,
        else add the Markov bias of the token before and pick or draw the slot's token."""
        markov, confidence = self.model.markov_head, self.model.confidence_head
        previous, alive = anchor, 1.0
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        survival: list[float] = []
        for slot in range(len(hidden)):
            before = None if markov is None else markov.markov_w1.weight[previous]
            if confidence is not None:
                features = hidden[slot] if before is None or not \
                    self.shape.confidence_with_markov else torch.cat([hidden[slot], before])
                c = float(torch.sigmoid(confidence.proj(features).float())[0])
                if c < self.threshold:
                    break
                alive *= c
                survival.append(alive)
            logits = base[slot] if before is None else base[slot] + markov.markov_w2(before)
            previous, row = self._pick(logits)
            tokens.append(previous)
            rows.append(row)
        probs = None if self._params.greedy or not rows else np.stack(rows)
        return Draft(tokens=tuple(tokens), probs=probs, source=self.name,
                     survival=tuple(survival))

    def _pick(self, logits: torch.Tensor) -> tuple[int, np.ndarray | None]:
        if self._params.greedy:
            return int(logits.argmax()), None
        q = warp(logits.double().cpu().numpy(), self._params)
        return sample(q, self._rng), q


# ---- loading -------------------------------------------------------------------------------


def load_dspark_drafter(target: Any, path: str, threshold: float = 0.0) -> DSparkDrafter:
    """A DSpark drafter folder (DeepSpec or speculators layout), checked against the target;
    threshold: the confidence below which a block stops (0: never)."""
    folder = Path(path).expanduser()
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SpecdeckError(f"cannot read {folder / 'config.json'}: {error}. Give a DSpark "
                            "drafter folder (config.json and model.safetensors)") from error
    config, shape = read_config(folder, raw)
    check_fit(folder, target, config, list(shape.layer_ids), shape.mask_token_id)
    rows = int(target.hf.get_output_embeddings().weight.shape[0])
    if config.vocab_size != rows:  # the Markov tables are indexed by the head's tokens
        raise SpecdeckError(f"{folder}: this DSpark drafter's vocabulary is "
                            f"{config.vocab_size} tokens, the target's output layer {rows}: "
                            "a reduced draft vocabulary is not supported yet, or it was "
                            "trained for another target")
    model = DSparkModel(config, shape)
    _load_weights(folder, model)
    model = model.to(device=target.device, dtype=target.hf.dtype).eval()
    return DSparkDrafter(target, model, shape, threshold)


def read_config(folder: Path, raw: Mapping[str, Any]) -> tuple[Qwen3Config, DSparkShape]:
    """The Qwen3 layer config and the DSpark shape of a DeepSpec or speculators config."""
    if has_dspark_stages(raw):
        raise SpecdeckError(dspark_stages_refusal(str(folder), raw))
    if raw.get("speculators_model_type") == "dspark":
        return _speculators(folder, raw)
    if DEEPSPEC not in (raw.get("architectures") or []):
        raise SpecdeckError(f"{folder} is not a DSpark drafter: its config names neither "
                            f"architectures [{DEEPSPEC!r}] (DeepSpec) nor "
                            "speculators_model_type 'dspark'")
    missing = [key for key in ("block_size", "target_layer_ids", "mask_token_id",
                               "markov_rank", "enable_confidence_head") if key not in raw]
    if missing:
        raise SpecdeckError(f"{folder}: this DSpark config lacks {', '.join(missing)}")
    layers = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map")}
    return Qwen3Config(**layers), _shape(folder, raw, [int(i) for i in raw["target_layer_ids"]],
                                         from_anchor=True)


def _speculators(folder: Path, raw: Mapping[str, Any]) -> tuple[Qwen3Config, DSparkShape]:
    layers = dict(raw.get("transformer_layer_config") or {})
    aux = raw.get("aux_hidden_state_layer_ids")
    if not layers or not aux or raw.get("mask_token_id") is None:
        raise SpecdeckError(f"{folder}: this speculators DSpark config lacks "
                            "transformer_layer_config, aux_hidden_state_layer_ids or "
                            "mask_token_id")
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) < int(layers.get("vocab_size") or 0):
        raise SpecdeckError(f"{folder}: this DSpark drafter drafts over a reduced vocabulary "
                            f"({draft_vocab} of {layers['vocab_size']} tokens, d2t), which is "
                            "not supported yet")
    # speculators count the embedding output as hidden state 0: layer i's output is i + 1
    ids = [int(i) - 1 for i in aux]
    settings = {"markov_rank": 256, "markov_head_type": "vanilla",
                "enable_confidence_head": True, "confidence_head_with_markov": True,
                "block_size": 8, **raw}  # speculators' defaults where a key is absent
    return (Qwen3Config(**{k: v for k, v in layers.items() if k != "architectures"}),
            _shape(folder, settings, ids, from_anchor=bool(raw.get("sample_from_anchor",
                                                                   True))))


def _shape(folder: Path, raw: Mapping[str, Any], ids: list[int], from_anchor: bool
           ) -> DSparkShape:
    rank = int(raw["markov_rank"])
    head = str(raw.get("markov_head_type", "vanilla")).lower()
    if rank and head not in HEAD_TYPES:
        raise SpecdeckError(f"{folder}: markov_head_type {head!r} is not supported yet (only "
                            f"{', '.join(HEAD_TYPES)}: its gate or recurrent state is not "
                            "implemented)")
    if any(i < 0 for i in ids):
        raise SpecdeckError(f"{folder}: target layer ids {ids} include the embedding output, "
                            "which specdeck does not capture")
    confidence = bool(raw["enable_confidence_head"])
    with_markov = confidence and bool(raw.get("confidence_head_with_markov", False))
    if with_markov and not rank:
        raise SpecdeckError(f"{folder}: confidence_head_with_markov needs a Markov head "
                            "(markov_rank is 0)")
    return DSparkShape(int(raw["block_size"]), int(raw["mask_token_id"]), tuple(ids), rank,
                       confidence, with_markov, from_anchor)


def _load_weights(folder: Path, model: DSparkModel) -> None:
    files, state = read_state(folder)
    state = {k: v for k, v in state.items() if k not in SHARED and k not in ("d2t", "t2d")}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a tensor of another shape than the config describes
        raise SpecdeckError(f"{folder}: its tensors do not match its config: "
                            f"{str(error).splitlines()[-1].strip()}") from error
    missing = [m for m in missing if not m.startswith("rotary.")]
    if not files:
        raise SpecdeckError(f"{folder} holds no safetensors: a DSpark drafter needs its "
                            "weights (model.safetensors)")
    if missing or unexpected:
        raise SpecdeckError(f"{folder} is not a DSpark drafter this config describes: missing "
                            f"tensors {sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}")
