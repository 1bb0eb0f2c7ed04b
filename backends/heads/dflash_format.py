"""The DFlash (1 and 2) drafter folder, read once for every backend (HEADS.md §3.1, §11.5).

Knows: the z-lab checkpoint's config.json (a Qwen3 config with `block_size`,
`dflash_config.{mask_token_id, target_layer_ids, input_embedding_scale}`, DFlash 2's
`dflash_config.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k}` and
optional `output_multiplier`, `final_logit_softcapping`), the default target-layer rule, the
checks against a target (given as numbers), and the stored tensor names and how they map to
the weight modules' (attention projections beside the MLP; codebooks with or without
`.weight`). Must not know: any array library, the modules' computations, drafting.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.types import SpecdeckError

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DFlash2Config:
    """The DFlash 2 shape: convolution kernel and group, selector rank and candidates."""

    kernel_size: int
    group_size: int
    rank: int
    top_k: int
    output_multiplier: float = 1.0
    softcap: float = 0.0

    @classmethod
    def read(cls, value: Callable[[str], Any]) -> DFlash2Config:
        """From a `key -> dflash_config or top-level value` lookup; KeyError names a key
        that is absent."""
        missing = [key for key in DFLASH2_KEYS if value(key) is None]
        if missing:
            raise KeyError(", ".join(missing))
        return cls(int(value("conv_kernel_size")), int(value("conv_group_size")),
                   int(value("selector_rank")), int(value("selector_top_k")),
                   float(value("output_multiplier") or 1.0),
                   float(value("final_logit_softcapping") or 0.0))


@dataclass(frozen=True)
class DFlashSpec:
    """A checked DFlash folder: its config (`config`, as stored, less `dflash_config`), the
    drafting constants, and DFlash 2's shape (`version2`, None for DFlash 1)."""

    folder: Path
    config: Mapping[str, Any]
    layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    embed_scale: float
    version2: DFlash2Config | None

    def get(self, key: str, default: Any = None) -> Any:
        """A key of the stored config."""
        return self.config.get(key, default)

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def head_dim(self) -> int:
        return int(self.get("head_dim") or self.hidden_size // self.get("num_attention_heads"))

    @property
    def rope(self) -> dict[str, Any]:
        """rope_parameters (transformers 5), else the older rope_theta and rope_scaling."""
        stored = self.get("rope_parameters")
        if isinstance(stored, dict) and "rope_theta" in stored:
            return dict(stored)
        return {**(self.get("rope_scaling") or {}),
                "rope_theta": float(self.get("rope_theta", 10000.0))}

    @property
    def weights(self) -> list[Path]:
        return sorted(self.folder.glob("*.safetensors"))


def default_layer_ids(n_target: int, n_draft: int) -> list[int]:
    """z-lab's rule when a checkpoint names no target layers: spread from 1 to N - 3."""
    if n_draft == 1:
        return [n_target // 2]
    return [round(1 + i * (n_target - 4) / (n_draft - 1)) for i in range(n_draft)]


def read_config(folder: Path, kind: str) -> dict[str, Any]:
    """A block drafter folder's config.json, or a refusal naming what the folder needs."""
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SpecdeckError(f"cannot read {folder / 'config.json'}: {error}. Give a {kind} "
                            "drafter folder (config.json and model.safetensors)") from error


def read_spec(path: str | Path, *, hidden_size: int, vocab_size: int, n_layers: int,
              head_rows: int) -> DFlashSpec:
    """The folder's spec, refused (naming why) when the drafter cannot run on a target of
    these sizes (head_rows: rows of the target's output layer)."""
    folder = Path(path).expanduser()
    raw = read_config(folder, "DFlash")
    extra = raw.get("dflash_config") or {}

    def value(key: str, default: Any = None) -> Any:
        return extra.get(key, raw.get(key, default))

    config = {k: v for k, v in raw.items() if k != "dflash_config"}
    if set(config.get("layer_types") or ["full_attention"]) != {"full_attention"} \
            or config.get("use_sliding_window") or value("causal") or raw.get("is_causal"):
        raise SpecdeckError(f"{folder}: causal or sliding-window DFlash layers are not supported "
                            "yet; use a drafter with full attention layers")
    n_target = int(raw.get("num_target_layers") or n_layers)
    layer_ids = tuple(value("target_layer_ids") or default_layer_ids(
        n_target, int(config["num_hidden_layers"])))
    mask = value("mask_token_id")
    check_target(folder, config, layer_ids, mask, hidden_size, vocab_size, n_layers)
    version2 = None
    if "DFlash2DraftModel" in (raw.get("architectures") or []):
        version2 = _dflash2_shape(folder, config, value, head_rows)
    return DFlashSpec(folder, config, layer_ids, int(value("block_size", 16)), int(mask),
                      float(value("input_embedding_scale", 1.0)), version2)


def module_names(stored: Mapping[str, Any]) -> dict[str, Any]:
    """Stored tensors under the weight modules' names: z-lab keeps the attention projections
    under `self_attn.`, the modules beside the MLP; published DFlash 2 checkpoints store the
    codebooks without `.weight` (both spellings load)."""
    renamed = {key.replace(".self_attn.", "."): value for key, value in stored.items()}
    return {key.removesuffix(".weight") if key.endswith("_codebook.weight") else key: value
            for key, value in renamed.items()}


def check_tensors(spec: DFlashSpec, missing: Iterable[str], unexpected: Iterable[str]) -> None:
    """Refuse a folder whose tensors are not exactly the modules' parameters."""
    missing, unexpected = sorted(missing), sorted(unexpected)
    if spec.version2 and missing and spec.weights:
        raise SpecdeckError(f"{spec.folder} is a DFlash 2 drafter without the tensors "
                            f"{missing[:6]}: its checkpoint is incomplete")
    if missing or unexpected or not spec.weights:
        raise SpecdeckError(f"{spec.folder} is not a DFlash drafter in the z-lab layout (missing "
                            f"{missing[:4]}, unexpected {unexpected[:4]})")


def _dflash2_shape(folder: Path, config: Mapping[str, Any], value: Callable[[str], Any],
                   head_rows: int) -> DFlash2Config:
    try:
        shape = DFlash2Config.read(value)
    except KeyError as error:
        raise SpecdeckError(f"{folder} is a DFlash 2 drafter whose dflash_config lacks "
                            f"{error.args[0]}") from error
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    if shape.group_size < 1 or hidden % shape.group_size:
        raise SpecdeckError(f"{folder}: conv_group_size {shape.group_size} does not divide "
                            f"the hidden size {hidden}")
    if vocab < head_rows:  # the codebooks are indexed by the head's candidates
        raise SpecdeckError(f"{folder}: the selector's codebooks cover {vocab} tokens, the "
                            f"target's output layer {head_rows}: it was trained for another "
                            "target")
    return shape


def check_target(folder: Path, config: Mapping[str, Any], layer_ids: tuple[int, ...],
                 mask: Any, hidden_size: int, vocab_size: int, n_layers: int) -> None:
    """SpecdeckError unless a block drafter's hidden size, mask token and target layers fit a
    target of these sizes (DFlash's and DSpark's folders alike)."""
    if int(config["hidden_size"]) != hidden_size:
        raise SpecdeckError(f"{folder}: this block drafter has hidden size "
                            f"{config['hidden_size']}, the target {hidden_size}: it was trained "
                            "for another target")
    if mask is None or not 0 <= int(mask) < vocab_size:
        raise SpecdeckError(f"{folder}: dflash_config.mask_token_id {mask!r} is not a token of "
                            f"the target (vocabulary {vocab_size})")
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise SpecdeckError(f"{folder}: target_layer_ids {bad} are outside the target's "
                            f"{n_layers} layers: it was trained for another target")
