"""A target's numbers: its architecture and parameter count, read from the catalogue, a config.json,
a safetensors header or a GGUF header.

Knows: the config and header formats, the catalogue's models.
Must not know: memory, drafters or the planner's choice.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.catalogue.registry import Arch, Catalogue, ModelSpec, load_catalogue
from app.catalogue.states import stream_state
from app.core.types import SpecdeckError
from app.drafters.own_layers import mtp_layers


@dataclass(frozen=True)
class TargetInfo:
    label: str  # what was asked for
    model: ModelSpec | None  # the catalogue entry, when the target is in the catalogue
    family: str | None
    params: int
    arch: Arch
    path: Path | None = None  # local file or folder, when given one


def describe(target: str, catalogue: Catalogue | None = None) -> TargetInfo:
    """Numbers of a target given as a pair id, catalogue model id, hub repo id or local path."""
    catalogue = catalogue or load_catalogue()
    model = _catalogue_model(target, catalogue)
    if model is not None:
        return TargetInfo(target, model, model.family, model.params, model.arch)
    path = Path(target).expanduser()
    if path.exists():
        arch, params = _local_numbers(path)
        same = _same_arch(arch, catalogue)  # its family tells which drafts share the tokenizer
        return TargetInfo(target, same, same.family if same else None, params, arch, path)
    raise SpecdeckError(f"unknown target {target!r}: give a pair id or model from `specdeck "
                        "models`, a catalogue hub id, or a local HF folder or .gguf file")


def _catalogue_model(target: str, catalogue: Catalogue) -> ModelSpec | None:
    if target in catalogue.pairs:
        return catalogue.pairs[target].target
    if target in catalogue.models:
        return catalogue.models[target]
    for model in catalogue.models.values():
        if any(getattr(s, "repo", None) == target for ss in model.sources.values() for s in ss):
            return model
    # a file the store installed: .../models/<model id>/<backend>/<file>
    parts = Path(target).parts
    for i, part in enumerate(parts[:-1]):
        if part == "models" and i + 1 < len(parts) and parts[i + 1] in catalogue.models:
            return catalogue.models[parts[i + 1]]
    return None


def _same_arch(arch: Arch, catalogue: Catalogue) -> ModelSpec | None:
    """A catalogue model with this shape: its family tells which drafts share the tokenizer."""
    for model in catalogue.models.values():
        a = model.arch
        if (a.layers, a.hidden, a.kv_heads, a.vocab) == (arch.layers, arch.hidden,
                                                          arch.kv_heads, arch.vocab):
            return model
    return None


def arch_from_config(config: dict[str, Any]) -> Arch:
    """The numbers of an HF config.json (multimodal configs keep them in text_config)."""
    c = config.get("text_config") or config
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    # NemotronH lists its blocks (layers_block_type) instead of counting them
    layers = c.get("num_hidden_layers") or len(c.get("layers_block_type") or ()) or \
        c["num_hidden_layers"]
    return Arch(layers=int(layers), hidden=hidden, heads=heads,
                kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or hidden // heads),
                vocab=int(c["vocab_size"]),
                context=int(c.get("max_position_embeddings") or 4096),
                mtp_layers=mtp_layers(config), kv_layers=_kv_layers(c),
                stream=stream_state(config), **_experts(c))


def _kv_layers(c: dict[str, Any]) -> int:
    """The layers that keep KV where layer types are listed (0: every layer does); Gemma 4's
    last num_kv_shared_layers reuse an earlier layer's keys and values, so keep none."""
    types = c.get("layer_types") or c.get("layers_block_type") or []
    attention = sum(t in ("full_attention", "sliding_attention", "attention") for t in types)
    return attention - int(c.get("num_kv_shared_layers") or 0) if attention else 0


def _experts(c: dict[str, Any]) -> dict[str, int]:
    """A MoE's routed experts and their intermediate size (gpt-oss names it intermediate_size,
    Qwen's MoEs moe_intermediate_size); none for a dense model."""
    experts = int(c.get("num_local_experts") or c.get("num_experts") or 0)
    ffn = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
    return {"experts": experts, "expert_ffn": ffn if experts else 0}


def _local_numbers(path: Path) -> tuple[Arch, int]:
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            arch = arch_from_config(config)
        except (OSError, ValueError, KeyError) as error:
            raise SpecdeckError(f"cannot read {path / 'config.json'}: {error}. Give an HF "
                                "model folder") from error
        params = sum(_safetensors_params(f) for f in path.glob("*.safetensors"))
        return arch, params or _estimate_params(arch)
    if path.suffix == ".gguf":
        return _gguf_numbers(path)
    raise SpecdeckError(f"{path} is neither an HF model folder nor a .gguf file")


def _safetensors_params(file: Path) -> int:
    """Element count from a safetensors header (8-byte length, then JSON); no tensor read."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def _estimate_params(arch: Arch) -> int:
    return 12 * arch.layers * arch.hidden**2 + arch.vocab * arch.hidden


def _gguf_numbers(path: Path) -> tuple[Arch, int]:
    try:
        from gguf import GGUFReader
    except ImportError as error:
        raise SpecdeckError("reading a .gguf needs the gguf package: pip install "
                            "'specdeck[torch]'") from error
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError, IndexError) as error:  # IndexError: a file cut short
        raise SpecdeckError(f"cannot read {path}: {error}. The file may be partial: download "
                            "it again") from error

    def value(key: str, default: Any = None) -> Any:
        fld = reader.fields.get(key)
        if fld is None:
            return default
        return fld.parts[fld.data[0]].tolist()[0] if fld.data else default

    name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    hidden = int(value(f"{name}.embedding_length"))
    heads = int(value(f"{name}.attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    arch = Arch(layers=int(value(f"{name}.block_count")), hidden=hidden, heads=heads,
                kv_heads=int(value(f"{name}.attention.head_count_kv", heads)),
                head_dim=int(value(f"{name}.attention.key_length", hidden // heads)),
                vocab=len(tokens.data) if tokens is not None else 0,
                context=int(value(f"{name}.context_length", 4096)),
                mtp_layers=int(value(f"{name}.nextn_predict_layers", 0)))
    params = sum(int(math.prod(int(d) for d in t.shape)) for t in reader.tensors)
    return arch, params
