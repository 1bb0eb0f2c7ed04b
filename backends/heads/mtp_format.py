"""Native MTP layers inside a target checkpoint: where each family keeps them, which tensors
are whose, and why a target's are refused; shared by every backend.

Knows: the layouts (HEADS.md §4): DeepSeek-V3 and GLM-4.5 `model.layers.{N}.{enorm, hnorm,
eh_proj, shared_head.{norm, head}}` plus a decoder layer, fused as
`eh_proj(cat(enorm(embed), hnorm(hidden)))`, embedding first; MiMo
`model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}` plus a
Qwen2 layer, fused as `input_proj(cat(hidden_layernorm(hidden), token_layernorm(embed)))`,
hidden first; Qwen3-Next / Qwen3.5 / Qwen3.6 `mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden,
fc, norm}` plus `mtp.layers.0.*`, a full-attention decoder layer of the target's own class,
fused as `fc(cat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)))`, embedding first
(vLLM's qwen3_5_mtp.py and qwen3_next_mtp.py; the norms are the target's own (1 + w) RMSNorm,
the embedding and output layer the target's). The names an MTP layer module gives its parts
on every backend (`proj`, `embed_norm`, `hidden_norm`, `out_norm`, `head`, `layer.*`), and
which of them are Qwen's (1 + w) norms. A Qwen3.5 / 3.6 MTP layer published apart from its
target is read by backends/heads/mtp_folder.py into the same MtpCheckpoint. Must not know:
an array library (tensor names are read from the safetensors headers; each backend
reads the tensors), drafting, the engine's loop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from app.core.types import SpecdeckError
from app.drafters.own_layers import dspark_stages_refusal, has_dspark_stages, mtp_layers
from backends.heads.mtp_dequant import Quantization, dequantized

T = TypeVar("T")
# per style: the stored names of the fusing projection, embedding norm, hidden norm, out norm
FUSE = {"deepseek": ("eh_proj", "enorm", "hnorm", "shared_head.norm"),
        "mimo": ("input_proj", "token_layernorm", "hidden_layernorm", "final_layernorm"),
        "qwen3_next": ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
QWEN_LAYER = "layers.0."  # Qwen3-Next / 3.5's first MTP decoder layer, inside `mtp.`
_PARTS = ("proj", "embed_norm", "hidden_norm", "out_norm")
OWN_HEAD = "shared_head.head.weight"  # DeepSeek's own output layer, when a checkpoint has one
# Qwen3-Next / 3.5's (1 + w) RMSNorms, under the module's names: transformers stores w, MLX's
# RMSNorm holds w + 1
ONE_PLUS_W_NORMS = ("embed_norm.weight", "hidden_norm.weight", "out_norm.weight",
                    "input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                    "k_norm.weight")


@dataclass(frozen=True)
class MtpLayout:
    """Where a checkpoint keeps its MTP layers."""

    style: str  # "deepseek" (DeepSeek-V3, GLM-4.5), "mimo" or "qwen3_next" (Qwen3-Next/3.5)
    prefixes: tuple[str, ...]  # one per MTP layer, e.g. "model.layers.46."


@dataclass(frozen=True)
class MtpCheckpoint:
    """A folder's MTP layout and, per safetensors file, the tensor names of its first MTP
    layer (the one that drafts).

    folder: set where the layer was published apart from the target (its refusals name it);
    mlx_form: its tensors are as MLX holds them (norms stored as w + 1, MoE experts stacked
    as `mlp.switch_mlp.{gate,up,down}_proj`), as mlx-vlm's split writes them;
    quantization: how a quantized folder stores its weights (split_layer reads them as float)."""

    layout: MtpLayout
    keys: Mapping[Path, tuple[str, ...]]
    folder: Path | None = None
    mlx_form: bool = False
    quantization: Quantization | None = None

    @property
    def prefix(self) -> str:
        return self.layout.prefixes[0]

    @property
    def described(self) -> str:
        """The layer as a refusal names it."""
        return f"the MTP layer in {self.folder}" if self.folder else \
            f"its MTP layer {self.prefix}"

    @property
    def index(self) -> int:
        """The first MTP layer's index: N for DeepSeek-style layers (past the last decoder
        layer), i for MiMo's, 0 for Qwen3-Next / 3.5's (`mtp.layers.0`)."""
        if self.layout.style == "qwen3_next":
            return 0
        return int(self.prefix.rstrip(".").rsplit(".", 1)[-1])


def detect_mtp(config: dict[str, Any], keys: Sequence[str]) -> MtpLayout | None:
    """The MTP layout a config and its tensor names declare, or None (DeepSeek-V4's DSpark
    stages, also under `mtp.*`, are no MTP layers)."""
    text = config.get("text_config") or config
    count = mtp_layers(config)
    if count < 1:
        return None
    names = set(keys)
    if any(k.startswith("mtp.") for k in names):
        return MtpLayout("qwen3_next", ("mtp.",))
    if any(k.startswith("model.mtp_layers.") for k in names):
        return MtpLayout("mimo", tuple(f"model.mtp_layers.{i}." for i in range(count)))
    first = int(text["num_hidden_layers"])
    prefixes = tuple(f"model.layers.{first + i}." for i in range(count))
    if all(f"{p}eh_proj.weight" in names for p in prefixes):
        return MtpLayout("deepseek", prefixes)
    return None


def read_layout(folder: Path) -> tuple[dict[str, Any], MtpLayout | None,
                                        dict[Path, tuple[str, ...]]]:
    """The folder's config, MTP layout and the tensor names of each safetensors file."""
    from safetensors import safe_open

    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    names: dict[Path, tuple[str, ...]] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:  # the header only: no tensor read
            names[file] = tuple(f.keys())
    keys = [k for file_keys in names.values() for k in file_keys]
    return config, detect_mtp(config, keys), names


def open_mtp(target: Any) -> MtpCheckpoint:
    """The MTP layers of `target`'s own folder (`target.source`); SpecdeckError naming why
    when it has none, they are DeepSeek-V4 DSpark stages, or the target cannot rewind."""
    folder = getattr(target, "source", None)
    config, layout, names = read_layout(folder) if folder is not None else ({}, None, {})
    if has_dspark_stages(config):
        raise SpecdeckError(dspark_stages_refusal(target.name, config))
    if layout is None and mtp_layers(config) > 0:  # a conversion dropped the tensors
        raise SpecdeckError(f"{target.name} has no native MTP layers (its config declares "
                            f"{mtp_layers(config)}, its files hold no MTP tensors): give "
                            "--draft MTP_DIR (the layer published apart, or the original "
                            "checkpoint), or pick another drafter, e.g. --drafter ngram")
    if layout is None:
        raise SpecdeckError(f"{target.name} has no native MTP layers (its config names no "
                            "num_nextn_predict_layers with MTP tensors): pick another drafter, "
                            "e.g. --drafter ngram")
    check_rewinds(target)
    return MtpCheckpoint(layout, first_layer_keys(names, layout))


def check_rewinds(target: Any) -> None:
    """SpecdeckError where the target cannot rewind a rejected draft token."""
    if not target.capabilities.rewind:
        raise SpecdeckError(f"{target.name} carries MTP layers but cannot speculate: "
                            f"{target.capabilities.reason}; use --drafter none")


def first_layer_keys(names: Mapping[Path, Sequence[str]], layout: MtpLayout
                     ) -> dict[Path, tuple[str, ...]]:
    """Per safetensors file, the names of the first MTP layer's tensors (files without any
    left out)."""
    prefix = layout.prefixes[0]
    keys = {file: tuple(k for k in file_keys if k.startswith(prefix) and _first_layer(k, layout))
            for file, file_keys in names.items()}
    return {file: k for file, k in keys.items() if k}


def _first_layer(key: str, layout: MtpLayout) -> bool:
    """Whether a tensor under the MTP prefix belongs to the first MTP layer (Qwen's `mtp.*`
    may hold more decoder layers, `mtp.layers.{i}`, beside the shared norms and fc)."""
    own = key.removeprefix(layout.prefixes[0])
    return layout.style != "qwen3_next" or not own.startswith("layers.") or \
        own.startswith(QWEN_LAYER)


def split_layer(stored: Mapping[str, T], checkpoint: MtpCheckpoint
                ) -> tuple[dict[str, T], dict[str, T]]:
    """An MTP layer's stored tensors (full names) as (the fusing parts under the module's names
    `proj.weight`, ..., `head.weight` when it has its own head; the decoder layer's tensors
    under their names inside the layer, per-expert MoE names as stored); a quantized folder's
    weights as float (backends/heads/mtp_dequant.py)."""
    stored = dequantized(stored, checkpoint.quantization)
    own = {k.removeprefix(checkpoint.prefix): v for k, v in stored.items()}
    fuse = {f"{part}.weight": own.pop(f"{name}.weight")
            for part, name in zip(_PARTS, FUSE[checkpoint.layout.style]) if f"{name}.weight" in own}
    if OWN_HEAD in own:
        fuse["head.weight"] = own.pop(OWN_HEAD)
    own.pop("embed_tokens.weight", None)  # DeepSeek's copy of the target's embedding
    if checkpoint.layout.style == "qwen3_next":
        own = {k.removeprefix(QWEN_LAYER): v for k, v in own.items()}
    return fuse, own


def mismatch(target: str, checkpoint: MtpCheckpoint, layer_class: str,
             missing: Sequence[str], unexpected: Sequence[str]) -> SpecdeckError:
    """The refusal of an MTP layer whose tensors are not those its module holds."""
    return SpecdeckError(f"{target}: {checkpoint.described} does not match a "
                         f"{layer_class} (missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]})")
