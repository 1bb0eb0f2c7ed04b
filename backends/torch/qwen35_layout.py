"""How llama.cpp stores a Qwen3.5 text model (GGUF architectures qwen35 and, with experts,
qwen35moe), and what undoes it.

Knows: the transforms llama.cpp's converter (convert_hf_to_gguf.py, Qwen3_5TextModel over its
Qwen3-Next class and value-head reorder base) applies to transformers' qwen3_5_text tensors:
dt_bias stored as ssm_dt.bias; A as -exp(A_log); the conv kernel squeezed; the (1 + w) norms
stored with their one added (all but the gated delta net's own norm); and, where a layer has
more value heads than key heads, value heads moved from grouped-by-key-head order to tiled
order on every tensor with a value-head axis (rows of in_proj_qkv's value block, in_proj_z,
in_proj_a, in_proj_b, A and dt_bias, the conv kernel's value channels; out_proj's columns).
Qwen3.5-MoE's converter (Qwen3_5MoeTextModel, over the same base) adds
only the experts, gate and up split apart and stored otherwise as they are (gguf_experts.py
computes on them). Must not know: files, kernels, sessions. Rows are undone by reading them
in another order (so quantized blocks stay as stored); out_proj's columns cross quantization
blocks, so its input is reordered instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

ARCHITECTURES = frozenset({"qwen35", "qwen35moe"})


def converter_name(hf_name: str) -> str:
    """The name the converter gives the gguf package's table for this parameter."""
    if hf_name.endswith(".linear_attn.dt_bias"):
        return hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    return hf_name


def row_order(hf_name: str, config: Any) -> np.ndarray | None:
    """For a matrix whose rows the converter moved, the stored row each HF row is; else None."""
    heads = _value_heads(config)
    if heads is None or ".linear_attn." not in hf_name:
        return None
    if ".in_proj_qkv." in hf_name:
        return _after_query_key(heads, config)
    if ".in_proj_z." in hf_name:
        return _stored_rows(heads, int(config.linear_value_head_dim))
    if ".in_proj_a." in hf_name or ".in_proj_b." in hf_name:
        return _stored_rows(heads, 1)
    return None


def input_order(hf_name: str, config: Any) -> np.ndarray | None:
    """For out_proj (its columns moved): which input each stored column reads; else None."""
    heads = _value_heads(config)
    if heads is None or not hf_name.endswith(".linear_attn.out_proj.weight"):
        return None
    return _tiled(heads, int(config.linear_value_head_dim))


def undo(hf_name: str, stored: torch.Tensor, config: Any) -> torch.Tensor:
    """A small tensor (F32 in the file, flat) as transformers holds it, still flat."""
    if hf_name.endswith(".linear_attn.A_log"):
        stored = torch.log(-stored)
    elif _offset_by_one(hf_name):
        stored = stored - 1.0
    heads = _value_heads(config)
    if heads is None:
        return stored
    if hf_name.endswith((".linear_attn.A_log", ".linear_attn.dt_bias")):
        return stored[torch.from_numpy(_stored_rows(heads, 1)).long()]
    if hf_name.endswith(".linear_attn.conv1d.weight"):
        channels = stored.reshape(-1, int(config.linear_conv_kernel_dim))
        order = torch.from_numpy(_after_query_key(heads, config)).long()
        return channels[order].reshape(-1)
    return stored


def _offset_by_one(hf_name: str) -> bool:
    """Qwen3.5's RMSNorms scale by (1 + w); the gated delta net's norm scales by w."""
    return hf_name.endswith("norm.weight") and not hf_name.endswith(".linear_attn.norm.weight")


def _value_heads(config: Any) -> tuple[int, int] | None:
    """(key heads, value heads per key head) where the converter reordered value heads."""
    keys = int(getattr(config, "linear_num_key_heads", 0) or 0)
    values = int(getattr(config, "linear_num_value_heads", 0) or 0)
    if keys <= 0 or values <= 0 or keys == values:
        return None
    return keys, values // keys


def _tiled(heads: tuple[int, int], head_dim: int) -> np.ndarray:
    """At each tiled position (value head within group, key head, dim), the grouped index
    (key head, value head within group, dim) stored there."""
    keys, per_key = heads
    grouped = np.arange(keys * per_key * head_dim).reshape(keys, per_key, head_dim)
    return grouped.swapaxes(0, 1).reshape(-1)


def _stored_rows(heads: tuple[int, int], head_dim: int) -> np.ndarray:
    """The tiled position of each grouped index: the inverse of _tiled."""
    return np.argsort(_tiled(heads, head_dim))


def _after_query_key(heads: tuple[int, int], config: Any) -> np.ndarray:
    """Fused q/k/v channels: query and key as stored, the value block reordered."""
    query_key = 2 * int(config.linear_key_head_dim) * int(config.linear_num_key_heads)
    values = _stored_rows(heads, int(config.linear_value_head_dim))
    return np.concatenate([np.arange(query_key), query_key + values])
