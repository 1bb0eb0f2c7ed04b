"""How llama.cpp stores a Qwen3.5 text model (GGUF architectures qwen35 and, with experts,
qwen35moe) and a Qwen3-Next one (qwen3next), and what undoes it.

Knows: the transforms llama.cpp's converter (convert_hf_to_gguf.py, Qwen3_5TextModel over its
Qwen3-Next class and value-head reorder base) applies to transformers' qwen3_5_text tensors:
dt_bias stored as ssm_dt.bias; A as -exp(A_log); the conv kernel squeezed; the (1 + w) norms
stored with their one added (all but the gated delta net's own norm); and, where a layer has
more value heads than key heads, value heads moved from grouped-by-key-head order to tiled
order on every tensor with a value-head axis (rows of in_proj_qkv's value block, in_proj_z,
in_proj_a, in_proj_b, A and dt_bias, the conv kernel's value channels; out_proj's columns).
Qwen3.5-MoE's converter (Qwen3_5MoeTextModel, over the same base) adds only the experts, gate
and up split apart and stored otherwise as they are (gguf_experts.py computes on them).
Qwen3-Next's (Qwen3NextModel, the base) moves no value heads; it splits the per-key-head
[q, k, v, z] rows of in_proj_qkvz into all heads' q, k, v (attn_qkv) and z (attn_gate), read
back as one layer over both; and, as transformers has no reader of its metadata, the config
is built here from the keys that converter writes. Must not know: files, kernels, sessions.
Rows are undone by reading them in another order (so quantized blocks stay as stored);
out_proj's columns cross quantization blocks, so its input is reordered instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

ARCHITECTURES = frozenset({"qwen35", "qwen35moe", "qwen3next"})


def converter_name(hf_name: str) -> str:
    """The name the converter gives the gguf package's table for this parameter."""
    if hf_name.endswith(".linear_attn.dt_bias"):
        return hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    return hf_name


def joined_rows(hf_name: str, config: Any) -> tuple[list[str], np.ndarray] | None:
    """For a matrix the converter stored as several tensors (Qwen3-Next's in_proj_qkvz): the
    HF-side names of those tensors, and for each HF row its row in their outputs side by
    side; else None."""
    if not hf_name.endswith(".linear_attn.in_proj_qkvz.weight"):
        return None
    keys, key_dim = int(config.linear_num_key_heads), int(config.linear_key_head_dim)
    per_key = int(config.linear_num_value_heads) // keys * int(config.linear_value_head_dim)
    # attn_qkv's rows: every head's q, then every head's k, then v; attn_gate's z after them
    head = np.arange(keys)[:, None]
    q = head * key_dim + np.arange(key_dim)
    k = keys * key_dim + q
    v = 2 * keys * key_dim + head * per_key + np.arange(per_key)
    z = 2 * keys * key_dim + keys * per_key + head * per_key + np.arange(per_key)
    stem = hf_name.removesuffix(".in_proj_qkvz.weight")
    return ([f"{stem}.in_proj_qkv", f"{stem}.in_proj_z"],
            np.concatenate([q, k, v, z], axis=1).reshape(-1))


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
    if config.model_type == "qwen3_next":
        return None  # the reorder is the Qwen3.5 classes' own
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


def qwen3next_config(metadata: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
    """A transformers Qwen3-Next config from a qwen3next GGUF's metadata (the keys
    Qwen3NextModel and the MoE and text classes under it write; `metadata` as transformers'
    read_gguf_metadata gives it, the vocabulary as its length)."""
    key = lambda name: metadata[f"qwen3next.{name}"]  # noqa: E731
    layers = int(key("block_count"))
    # written where the checkpoint's config names head_dim (Qwen3-Next's does)
    head_dim = int(metadata.get("qwen3next.attention.key_length")
                   or int(key("embedding_length")) // int(key("attention.head_count")))
    value_heads, interval = int(key("ssm.time_step_rank")), int(key("full_attention_interval"))
    # the converter writes every layer's router; a dense layer (mlp_only_layers) has none
    routed = {int(name.split(".")[1]) for name in tensor_names
              if name.startswith("blk.") and name.endswith(".ffn_gate_inp.weight")}
    config = {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
        "vocab_size": metadata["tokenizer.ggml.tokens"],
        "max_position_embeddings": key("context_length"), "hidden_size": key("embedding_length"),
        "num_hidden_layers": layers, "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"), "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(layers)],
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_key_heads": key("ssm.group_count"), "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
        # a rotary width in dimensions, where transformers takes a fraction of the head
        "rope_parameters": {"rope_type": "default", "rope_theta": key("rope.freq_base"),
                            "partial_rotary_factor": key("rope.dimension_count") / head_dim},
        "num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length"),
        "norm_topk_prob": bool(metadata.get("qwen3next.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if i not in routed],
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if (feed_forward := metadata.get("qwen3next.feed_forward_length")) is not None:
        config["intermediate_size"] = feed_forward
    return config
