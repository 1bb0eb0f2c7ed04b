"""mlx-lm 0.32 model classes made to compute what transformers 5.25 computes from the same
config, where mlx-lm's own reading differs:

- a windowed Mistral (model_type mistral, sliding_window set, no full layer): transformers'
  Mistral windows every layer; mlx-lm builds it as its llama, which windows only the layers
  layer_types names and needs one full layer (its full mask is read off one). Here every
  layer slides, so make_cache gives each a rotating window (a WindowCache in a session) and
  every layer reads the window mask;
- gpt-oss's YaRN with `truncate: false` (the published checkpoints' config): transformers
  keeps the correction range unrounded, mlx-lm's YarnRoPE always rounds it (floor, ceil),
  which moves the frequencies of the dimensions at its edges;
- gpt-oss's swiglu_alpha and swiglu_limit, which mlx-lm's SwigluOAI takes at its defaults
  (1.702, 7.0) whatever the config says.

Knows: mlx-lm's llama and gpt_oss layer attributes (use_sliding, swa_idx, self_attn.rope and
the periods its YarnRoPE hands mx.fast.rope, mlp.experts.activation), transformers' YaRN
formula.
Must not know: weight names (layouts.py), sessions, rewinds, drafting.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
from mlx_lm.models.activations import SwigluOAI


def windows_every_layer(config: dict[str, Any]) -> bool:
    """Whether transformers windows every layer of config while mlx-lm's llama would window
    none: a Mistral with sliding_window set and no full-attention layer named."""
    types = config.get("layer_types") or ()
    return (config.get("model_type") == "mistral" and bool(config.get("sliding_window"))
            and "full_attention" not in types)


def every_layer_windowed(model: type) -> type:
    """mlx-lm's llama Model class with every layer on the sliding window."""
    def __init__(self: Any, args: Any) -> None:
        n = args.num_hidden_layers
        # built as all full (mlx-lm's llama looks a full layer up), then each turned sliding
        model.__init__(self, dataclasses.replace(args, layer_types=["full_attention"] * n))
        for layer in self.layers:
            layer.use_sliding = True
        self.model.swa_idx = 0
        self.model.layer_types = self.args.layer_types = ["sliding_attention"] * n
    return subclass(model, {"__init__": __init__})


def gpt_oss(model: type, config: dict[str, Any]) -> type:
    """mlx-lm's gpt_oss Model class with the config's SwiGLU clamp and slope, its RoPE on
    transformers' unrounded YaRN range where the config asks for it (truncate false)."""
    scaling = config.get("rope_scaling") or {}
    unrounded = scaling.get("rope_type") == "yarn" and scaling.get("truncate", True) is False
    alpha, limit = float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0))

    def __init__(self: Any, args: Any) -> None:
        model.__init__(self, args)
        periods = yarn_periods(args.head_dim, float(args.rope_theta), scaling) \
            if unrounded else None
        for layer in self.layers:
            layer.mlp.experts.activation = SwigluOAI(alpha=alpha, limit=limit)
            if periods is not None:
                # the per-dimension periods mlx-lm's YarnRoPE passes to mx.fast.rope as
                # freqs; its input scale (YaRN's attention factor) is transformers' already
                layer.self_attn.rope._freqs = periods
    return subclass(model, {"__init__": __init__})


def subclass(model: type, members: dict[str, Any]) -> type:
    """model's subclass with members, named and placed as model is: tree.py reads a net's
    module to know whose attention it runs."""
    return type(model.__name__, (model,), {"__module__": model.__module__,
                                           "__qualname__": model.__qualname__, **members})


def yarn_periods(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """1 / inverse frequency per rotated pair of YaRN with its correction range unrounded
    (transformers' _compute_yarn_parameters with truncate false)."""
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])

    def edge(rotations: float) -> float:  # the dimension turning `rotations` times
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(edge(float(scaling.get("beta_fast") or 32)), 0.0)
    high = min(edge(float(scaling.get("beta_slow") or 1)), dims - 1.0)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0.0, 1.0)
    extrapolated = 1.0 - ramp  # the share of each pair kept at its trained frequency
    inverse = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    return 1.0 / (inverse / factor * (1.0 - extrapolated) + inverse * extrapolated)
