"""Config and weight layouts mlx-lm 0.32 misreads, put in the shape it reads: transformers 5's
nested rope_parameters and layer_types, Gemma 4's per_layer_config (transformers 5.25 writes
the full layers' head size and key heads there, not as global_head_dim), the text-only
Qwen3.5 layout (model_type qwen3_5_text, `model.*` tensors) beside the multimodal one it
expects (qwen3_5 with a text_config, `model.language_model.*`, `mtp.*` beside them),
per-expert MoE tensors, gpt-oss's fused experts as transformers 5 holds them.

Knows: config keys and tensor names of the families mlx-lm loads. Must not know: caches,
sessions, drafting.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.utils import _get_classes  # load_model's own default, wrapped below

from backends.mlx import exact

# text-only model types transformers 5 writes, and the mlx-lm module reading them as a
# text_config-less config
_TEXT_ONLY = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# gpt-oss's unquantized experts as transformers 5 saves them: [experts, in, out] matrices
_OSS_EXPERT = re.compile(r"(.*\.mlp\.experts\.(?:gate_up|down)_proj)$")


def config_fixes(config: dict[str, Any]) -> dict[str, Any]:
    """The keys to override in config so that mlx-lm builds the model transformers would."""
    fixes = {"model_type": _TEXT_ONLY[config["model_type"]]} \
        if config.get("model_type") in _TEXT_ONLY else {}
    text = config.get("text_config")
    if isinstance(text, dict):
        return fixes | {"text_config": text | _text_fixes(text)}
    return fixes | _text_fixes(config)


def _text_fixes(config: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys mlx-lm reads but transformers 5 nests in rope_parameters (or writes as
    layer_types).

    Without them mlx-lm silently falls back to its default rope_theta (10000 for llama,
    where SmolLM2 needs 100000) and produces wrong logits.
    """
    fixes = _layer_pattern(config) | _per_layer_heads(config)
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in config:
        return fixes
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope and key not in config:
            fixes[key] = rope[key]
    if rope.get("rope_type", "default") != "default" and not config.get("rope_scaling"):
        fixes["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return fixes


def _layer_pattern(config: dict[str, Any]) -> dict[str, Any]:
    """Every p-th layer full, from the layer_types transformers 5 writes: mlx-lm reads it as
    sliding_window_pattern (Gemma 3) or full_attention_interval (Qwen3.5, Qwen3-Next), and
    its defaults misread other layouts."""
    types = config.get("layer_types")
    if not types or "full_attention" not in types:
        return {}
    period = types.index("full_attention") + 1
    if not all((t == "full_attention") == ((i + 1) % period == 0) for i, t in enumerate(types)):
        return {}
    key = "full_attention_interval" if "linear_attention" in types else "sliding_window_pattern"
    return {} if key in config else {key: period}


def _per_layer_heads(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's full-attention head size and key heads, which transformers 5.25 writes as
    per_layer_config overrides (none where they equal the sliding layers'): without them
    mlx-lm builds its default global_head_dim of 512."""
    layers = config.get("per_layer_config")
    if config.get("model_type") != "gemma4_text" or not isinstance(layers, dict) \
            or "global_head_dim" in config:
        return {}
    types = config.get("layer_types") or ()
    full = next((layers.get(str(i)) or layers.get(i) or {} for i, kind in enumerate(types)
                 if kind == "full_attention"), {})
    fixes = {"global_head_dim": full.get("head_dim", config.get("head_dim"))}
    if "num_key_value_heads" in full and "num_global_key_value_heads" not in config:
        fixes["num_global_key_value_heads"] = full["num_key_value_heads"]
    return {k: v for k, v in fixes.items() if v is not None}


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's classes for config; Qwen3.5-MoE's also reads per-expert tensors and gpt-oss's
    transformers' fused [experts, in, out] ones, as transformers 5 saves them, beside the
    layouts mlx-lm expects; gpt-oss's and a windowed Mistral's compute as transformers'
    (backends/mlx/exact.py)."""
    model, args = _get_classes(config)
    kind = config.get("model_type")
    if kind == "qwen3_5_moe":
        return _sanitizing_first(model, fuse_experts), args
    if kind == "gpt_oss":
        return exact.gpt_oss(_sanitizing_first(model, oss_experts), config), args
    if exact.windows_every_layer(config):
        return exact.every_layer_windowed(model), args
    return model, args


def _sanitizing_first(model: type, fix: Callable[[dict[str, mx.array]], dict[str, mx.array]],
                      ) -> type:
    """model, its sanitize reading the weights fix gives."""
    def sanitize(self: Any, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return model.sanitize(self, fix(weights))
    return exact.subclass(model, {"sanitize": sanitize})


def oss_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """gpt-oss's `experts.gate_up_proj` and `experts.down_proj` as transformers 5 holds and
    saves them ([experts, in, out], gate and up interleaved on the last axis) in the layout of
    the published MXFP4 checkpoints dequantized ([experts, out, in], named `.weight`), which
    mlx-lm's sanitize splits into gate and up rows. The biases are already in that layout.

    Read by name, not shape: down_proj is square wherever hidden_size equals
    intermediate_size (gpt-oss-20b's 2880 both), so its shape cannot tell the layouts apart.
    """
    out = {}
    for name, value in weights.items():
        if _OSS_EXPERT.match(name):
            out[f"{name}.weight"] = mx.swapaxes(value, -1, -2)
        else:
            out[name] = value
    return out


def fuse_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """`experts.{e}.{gate,up,down}_proj.weight` stacked into `experts.gate_up_proj` and
    `experts.down_proj`, the layout of the published Qwen3.5-MoE checkpoints."""
    groups: dict[str, dict[str, dict[int, mx.array]]] = {}
    out = {}
    for name, value in weights.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = value
        else:
            prefix, expert, part = match.groups()
            groups.setdefault(prefix, {}).setdefault(part, {})[int(expert)] = value
    for prefix, parts in groups.items():
        stack = {part: mx.stack([rows[e] for e in sorted(rows)]) for part, rows in parts.items()}
        out[f"{prefix}.gate_up_proj"] = mx.concatenate([stack["gate"], stack["up"]], axis=-2)
        out[f"{prefix}.down_proj"] = stack["down"]
    return out
