"""A target's numbers: its architecture and parameter count, read from the catalogue, a config.json,
a safetensors header or a GGUF header.

Knows: the config and header formats, the catalogue's models.
Must not know: memory, drafters or the planner's choice.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app.catalogue.registry import Arch, Catalogue, ModelSpec, load_catalogue
from app.catalogue.states import stream_state
from app.core.types import SpecdeckError
from app.drafters.own_layers import mtp_layers
from backends.heads.mtp_format import detect_mtp


@dataclass(frozen=True)
class TargetInfo:
    label: str  # what was asked for
    model: ModelSpec | None  # the catalogue entry, when the target is in the catalogue
    family: str | None
    params: int
    arch: Arch
    path: Path | None = None  # local file or folder, when given one
    # MTP layers its config declares that its files no longer hold (a conversion dropped
    # them): arch counts none, and the planner says so
    mtp_dropped: int = 0


def describe(target: str, catalogue: Catalogue | None = None) -> TargetInfo:
    """Numbers of a target given as a pair id, catalogue model id, hub repo id or local path."""
    catalogue = catalogue or load_catalogue()
    model = _catalogue_model(target, catalogue)
    if model is not None:
        return TargetInfo(target, model, model.family, model.params, model.arch)
    path = Path(target).expanduser()
    if path.exists():
        arch, params, dropped = _local_numbers(path)
        same = _same_arch(arch, catalogue)  # its family tells which drafts share the tokenizer
        return TargetInfo(target, same, same.family if same else None, params, arch, path,
                          dropped)
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
                mtp_layers=mtp_layers(config), kv_layers=len(_kv_types(c)),
                stream=stream_state(config), **_experts(c), **_window(c), **_full_geometry(c))


_ATTENTION = ("full_attention", "sliding_attention", "attention")
SLIDING = "sliding_attention"
# the sliding pattern transformers 5.25's config classes build where a config.json lists no
# layer_types: all but every nth layer slide (Gemma 2 and gpt-oss alternate); a config's
# sliding_window_pattern overrides it (Gemma 3, Cohere 2)
_PATTERNS = {"gemma2": 2, "gpt_oss": 2, "gemma3_text": 6, "gemma4_text": 6, "cohere2": 4}
GEMMA4_GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's global_head_dim where a config omits it


def _layer_types(c: dict[str, Any]) -> list[str]:
    """Each layer's type as transformers 5.25 gives it: the listed ones, else from the window
    fields (none for a model without a window)."""
    listed = c.get("layer_types") or c.get("layers_block_type")
    if listed:
        return list(listed)
    layers = int(c.get("num_hidden_layers") or 0)
    if not c.get("sliding_window") or c.get("use_sliding_window") is False:
        return []
    if "use_sliding_window" in c:  # Qwen2's: the layers from max_window_layers on slide
        first = int(c.get("max_window_layers") or 0)
        return ["full_attention" if i < first else SLIDING for i in range(layers)]
    pattern = c.get("sliding_window_pattern") or _PATTERNS.get(str(c.get("model_type")))
    if pattern:
        return [SLIDING if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]
    # Mistral, Phi-3, Starcoder2: transformers' cache windows every layer
    return [SLIDING] * layers


def _kv_types(c: dict[str, Any]) -> list[str]:
    """The types of the layers that keep KV where layer types are known (none listed: every
    layer does); Gemma 4's last num_kv_shared_layers reuse an earlier layer's keys and values,
    so keep none."""
    types = _layer_types(c)
    kept = types[:len(types) - int(c.get("num_kv_shared_layers") or 0)]
    return [t for t in kept if t in _ATTENTION]


def _window(c: dict[str, Any]) -> dict[str, int]:
    """The sliding window and how many KV-keeping layers slide (none without both)."""
    sliding = _kv_types(c).count(SLIDING)
    window = int(c.get("sliding_window") or 0)
    return {"window": window, "sliding_layers": sliding} if sliding and window else {}


def _full_geometry(c: dict[str, Any]) -> dict[str, Any]:
    """The full-attention layers' KV heads and head dim where they differ from the sliding
    layers' (Gemma 4), and whether their values come from their keys' projection."""
    types = _kv_types(c)
    if SLIDING not in types or "full_attention" not in types:
        return {}
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    dim = int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))
    full = _per_layer_full(c, heads, dim) or _global_full(c, heads, dim)
    k_eq_v = bool(c.get("attention_k_eq_v"))
    if full == (heads, dim) and not k_eq_v:
        return {}
    return {"full_kv_heads": full[0], "full_head_dim": full[1], "k_eq_v": k_eq_v}


def _per_layer_full(c: dict[str, Any], heads: int, dim: int) -> tuple[int, int] | None:
    """The largest full layer's (kv heads, head dim) from per_layer_config, keyed by layer
    index ("05"), as transformers 5.25 saves a Gemma 4 config; None where it has none."""
    overrides = c.get("per_layer_config") or {}
    types = _layer_types(c)
    found = [(int(o.get("num_key_value_heads") or heads), int(o.get("head_dim") or dim))
             for key, o in overrides.items()
             if str(key).isdigit() and int(key) < len(types) and types[int(key)] != SLIDING]
    return max(found, key=lambda hd: hd[0] * hd[1]) if found else None


def _global_full(c: dict[str, Any], heads: int, dim: int) -> tuple[int, int]:
    """Gemma 4's global_head_dim and, only where attention_k_eq_v (as transformers and mlx-lm
    read it), num_global_key_value_heads; the sliding geometry for other models."""
    if "global_head_dim" not in c and c.get("model_type") != "gemma4_text":
        return heads, dim
    global_heads = c.get("num_global_key_value_heads")
    return (int(global_heads) if c.get("attention_k_eq_v") and global_heads else heads,
            int(c.get("global_head_dim") or GEMMA4_GLOBAL_HEAD_DIM))


def _experts(c: dict[str, Any]) -> dict[str, int]:
    """A MoE's routed experts and their intermediate size (gpt-oss names it intermediate_size,
    Qwen's MoEs moe_intermediate_size); none for a dense model."""
    experts = int(c.get("num_local_experts") or c.get("num_experts") or 0)
    ffn = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
    return {"experts": experts, "expert_ffn": ffn if experts else 0}


def _local_numbers(path: Path) -> tuple[Arch, int, int]:
    """A local target's arch, parameters and MTP layers its files dropped."""
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            arch = arch_from_config(config)
        except (OSError, ValueError, KeyError) as error:
            raise SpecdeckError(f"cannot read {path / 'config.json'}: {error}. Give an HF "
                                "model folder") from error
        headers = [_safetensors_header(f) for f in sorted(path.glob("*.safetensors"))]
        names = [name for header in headers for name in header if name != "__metadata__"]
        dropped = 0
        if arch.mtp_layers and names and detect_mtp(config, names) is None:
            # a conversion that dropped the layers (mlx-lm's): auto must not pick mtp on it
            arch, dropped = replace(arch, mtp_layers=0), arch.mtp_layers
        params = sum(_params(header) for header in headers)
        return arch, params or _estimate_params(arch), dropped
    if path.suffix == ".gguf":
        return (*_gguf_numbers(path), 0)
    raise SpecdeckError(f"{path} is neither an HF model folder nor a .gguf file")


def _safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's header (8-byte length, then JSON); no tensor read."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _params(header: dict[str, Any]) -> int:
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
