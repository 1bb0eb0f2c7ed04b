"""The DSpark drafter folder, read once for every backend (HEADS.md §11.1-11.3).

Knows: DeepSpec's small-model checkpoint (`Qwen3DSparkModel`: a Qwen3 config with
`block_size`, `target_layer_ids`, `mask_token_id`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`; tensors under DFlash 1's names plus
`markov_head.markov_w{1,2}.weight`, `confidence_head.proj.{weight,bias}`, and copies
`embed_tokens`, `lm_head` of the target's, which are not loaded) and speculators' DSpark
format (`speculators_model_type: dspark`, `transformer_layer_config`,
`aux_hidden_state_layer_ids` = layer outputs + 1, `sample_from_anchor`, default True), the
checks against a target given as numbers. Must not know: any array library, the modules'
computations, drafting. The layers are DFlash's, so the spec carries a DFlashSpec that each
backend's DFlash modules are built from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.types import SpecdeckError
from app.drafters.own_layers import dspark_stages_refusal, has_dspark_stages
from backends.heads.dflash_format import DFlashSpec, check_target, read_config

DEEPSPEC = "Qwen3DSparkModel"
HEAD_TYPES = ("vanilla",)  # DeepSpec's gated and rnn heads carry more tensors and a state
NOT_LOADED = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")  # the target's are used


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


@dataclass(frozen=True)
class DSparkSpec:
    """A checked DSpark folder: its layers (as a DFlash 1 spec) and its DSpark shape."""

    layers: DFlashSpec
    shape: DSparkShape

    @property
    def folder(self) -> Path:
        return self.layers.folder


def read_dspark(path: str | Path, *, hidden_size: int, vocab_size: int, n_layers: int,
                head_rows: int) -> DSparkSpec:
    """The folder's spec, refused (naming why) when the drafter cannot run on a target of
    these sizes (head_rows: rows of the target's output layer)."""
    folder = Path(path).expanduser()
    raw = read_config(folder, "DSpark")
    config, shape = _read_config(folder, raw)
    check_target(folder, config, shape.layer_ids, shape.mask_token_id, hidden_size,
                 vocab_size, n_layers)
    if int(config["vocab_size"]) != head_rows:  # the Markov tables are indexed by its tokens
        raise SpecdeckError(f"{folder}: this DSpark drafter's vocabulary is "
                            f"{config['vocab_size']} tokens, the target's output layer "
                            f"{head_rows}: a reduced draft vocabulary is not supported yet, or "
                            "it was trained for another target")
    layers = DFlashSpec(folder, config, shape.layer_ids, shape.block_size, shape.mask_token_id,
                        1.0, None)
    return DSparkSpec(layers, shape)


def stored_names(stored: Mapping[str, Any]) -> dict[str, Any]:
    """The stored tensors the modules load, under their names (the attention projections
    beside the MLP, as DFlash's)."""
    return {key.replace(".self_attn.", "."): value for key, value in stored.items()
            if key not in NOT_LOADED}


def check_tensors(spec: DSparkSpec, missing: Iterable[str], unexpected: Iterable[str]) -> None:
    """Refuse a folder whose tensors are not exactly the modules' parameters."""
    missing, unexpected = sorted(missing), sorted(unexpected)
    if not spec.layers.weights:
        raise SpecdeckError(f"{spec.folder} holds no safetensors: a DSpark drafter needs its "
                            "weights (model.safetensors)")
    if missing or unexpected:
        raise SpecdeckError(f"{spec.folder} is not a DSpark drafter this config describes: "
                            f"missing tensors {missing[:6]}, unexpected {unexpected[:6]}")


def _read_config(folder: Path, raw: Mapping[str, Any]) -> tuple[dict[str, Any], DSparkShape]:
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
    return layers, _shape(folder, raw, [int(i) for i in raw["target_layer_ids"]],
                          from_anchor=True)


def _speculators(folder: Path, raw: Mapping[str, Any]) -> tuple[dict[str, Any], DSparkShape]:
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
    return ({k: v for k, v in layers.items() if k != "architectures"},
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
