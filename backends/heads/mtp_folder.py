"""A Qwen3.5 / 3.6 MTP layer published apart from its target (for a target whose conversion
dropped its `mtp.*` tensors): recognising such a folder, reading its safetensors headers,
checking it against the target before anything loads, and presenting it as the MtpCheckpoint
every backend's MTP loader reads.

Knows: the two layouts such a folder comes in (docs/DRAFTERS.md, "MTP layers published
apart"): mlx-vlm's split (`config.json` of model_type `qwen3_5_mtp` whose `text_config` is
the target's, tensors named without `mtp.`, norms stored as w + 1, MoE experts stacked as
`switch_mlp`: MLX's form), and the layout vLLM's and SGLang's MTP loaders read (a Qwen3.5
config and the `mtp.*` tensors as the target's own checkpoint stores them: the original
checkpoint itself is one); which config keys fix the layer's geometry (checked on the
shapes of the weights a quantized folder's tensors stand for: backends/heads/mtp_dequant.py
reads block FP8 and MLX affine folders, and refuses any other quantization). Must not know:
an array library (the headers are read with safetensors' reader; each backend reads the
tensors), drafting, surfaces.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.core.types import SpecdeckError
from app.drafters.own_layers import has_dspark_stages
from backends.heads.mtp_dequant import Stored, read_quantization
from backends.heads.mtp_format import (
    MtpCheckpoint,
    MtpLayout,
    check_rewinds,
    first_layer_keys,
)

MTP_MODEL_TYPE = "qwen3_5_mtp"  # mlx-vlm's split; vLLM's name for the drafter it builds
MTP_ARCHITECTURES = frozenset({"Qwen3_5MTP", "Qwen3_5MoeMTP"})  # vLLM's drafter classes
HF_PREFIX, SPLIT_PREFIX = "mtp.", ""  # the tensors' prefix in the two layouts
FC = "fc.weight"
# the config keys that fix the layer's shapes, and the target it was split from
GEOMETRY = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
            "num_experts", "shared_expert_intermediate_size")


def is_mtp_folder(path: str | Path) -> bool:
    """Whether path is a folder holding only an MTP layer (its config's model_type or
    architectures say so): what --drafter auto recognises as the `mtp` kind's input."""
    config = _config(Path(path))
    if config is None:
        return False
    return config.get("model_type") == MTP_MODEL_TYPE or \
        bool(MTP_ARCHITECTURES & set(config.get("architectures") or ()))


def open_mtp_folder(folder: str | Path, target: Any, target_config: Mapping[str, Any]
                    ) -> MtpCheckpoint:
    """The first MTP layer of a separately published folder, checked against the target
    (target_config: its text model's config) from the headers alone; SpecdeckError naming
    both where the folder was made for another target, holds no Qwen MTP layer or holds
    tensors quantized in a form specdeck does not read (block FP8 and MLX affine ones are
    read as float: the checkpoint carries their quantization)."""
    folder = Path(folder).expanduser()
    config = _config(folder)
    if config is None:
        raise SpecdeckError(f"{folder} is no MTP folder: it has no readable config.json")
    if has_dspark_stages(config):
        raise SpecdeckError(f"{folder} holds DeepSeek-V4 DSpark stages, not an MTP layer")
    headers = _headers(folder)
    stored = {key: tensor for file_headers in headers.values()
              for key, tensor in file_headers.items()}
    prefix = _prefix(folder, stored)
    # the MTP layer's tensors only: a whole checkpoint given as the folder holds the target's
    stored = {key: tensor for key, tensor in stored.items() if key.startswith(prefix)}
    quantization = read_quantization(folder, config, stored)
    shapes = {key: quantization.shape(key, tensor) if quantization else tensor.shape
              for key, tensor in stored.items()}
    _check_geometry(folder, config, shapes, prefix, target.name, target_config)
    check_rewinds(target)
    layout = MtpLayout("qwen3_next", (prefix,))
    names = {file: tuple(file_headers) for file, file_headers in headers.items()}
    return MtpCheckpoint(layout, first_layer_keys(names, layout), folder=folder,
                         mlx_form=prefix == SPLIT_PREFIX, quantization=quantization)


def _config(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _headers(folder: Path) -> dict[Path, dict[str, Stored]]:
    """Per safetensors file, each tensor's name, shape and dtype (the header only: no tensor
    read)."""
    from safetensors import safe_open

    headers: dict[Path, dict[str, Stored]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            headers[file] = {key: Stored(tuple(f.get_slice(key).get_shape()),
                                         f.get_slice(key).get_dtype()) for key in f.keys()}
    return headers


def _prefix(folder: Path, stored: Mapping[str, Stored]) -> str:
    """The layout's tensor prefix: `mtp.` as the target stores them, or none (the split)."""
    for prefix in (HF_PREFIX, SPLIT_PREFIX):
        if f"{prefix}{FC}" in stored:
            return prefix
    raise SpecdeckError(f"{folder} holds no Qwen3.5 / 3.6 MTP layer (no {HF_PREFIX}{FC} or "
                        f"{FC} among its safetensors tensors)")


def _check_geometry(folder: Path, config: Mapping[str, Any],
                    shapes: Mapping[str, tuple[int, ...]], prefix: str,
                    target: str, target_config: Mapping[str, Any]) -> None:
    """Refuse a folder made for another target, naming both and what differs (shapes: of
    the weights the tensors stand for)."""
    text = config.get("text_config") or config
    differ = [f"{key} {text[key]} against {target_config[key]}" for key in GEOMETRY
              if text.get(key) is not None and target_config.get(key) is not None
              and text[key] != target_config[key]]
    hidden = int(target_config.get("hidden_size") or 0)
    fc = shapes[f"{prefix}{FC}"]
    if hidden and tuple(fc) != (hidden, 2 * hidden):
        differ.append(f"{prefix}{FC} of shape {list(fc)} against [{hidden}, {2 * hidden}]")
    if differ:
        raise SpecdeckError(f"{folder} is an MTP layer for another target than {target}: "
                            f"{'; '.join(differ)}")
