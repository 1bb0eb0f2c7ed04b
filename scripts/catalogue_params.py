"""Count a catalogue model's parameters as transformers builds it: on the meta device, from the
config numbers public sources quote (no hub access here), plus what transformers drops (a
native MTP layer) or has no class for (a DFlash drafter's own layers).

Usage: catalogue_params.py [MODEL_ID ...]   (every model listed here by default)

Prints, per model, the count models.yaml's `params` must equal and, for a MoE, the expert
weights (the tensors an MXFP4 checkpoint stores at 4.25 bits). tests/test_registry.py holds
the catalogue to these counts. Nothing is allocated: meta tensors have shapes only.
"""

from __future__ import annotations

import sys
from typing import Any

# the Gated DeltaNet numbers every Qwen3.5 / 3.6 text config quotes
_DELTA_NET = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
_QWEN36_35B = {"hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
               "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 248320,
               "max_position_embeddings": 262144, "num_experts": 256, "num_experts_per_tok": 8,
               "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
               "tie_word_embeddings": False, **_DELTA_NET}
_QWEN35_4B = {"hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 16,
              "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216,
              "vocab_size": 248320, "max_position_embeddings": 262144,
              "tie_word_embeddings": True, **_DELTA_NET}
# z-lab/Qwen3.5-4B-DFlash: six Qwen3 layers over eight target layers' hidden states
_DFLASH_QWEN35_4B = {"hidden_size": 2560, "num_hidden_layers": 6, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9216,
                     "vocab_size": 248320, "max_position_embeddings": 262144}
_DFLASH_TARGET_LAYERS = 8  # dflash_config.target_layer_ids [1, 5, 9, ..., 29]
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                   "partial_rotary_factor": 0.25}}


def _gemma4_layers(count: int) -> list[str]:
    """Five sliding-window layers, then one full-attention layer, repeated."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(count)]


_GEMMA4_E4B = {"hidden_size": 2560, "num_hidden_layers": 42, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512,
               "intermediate_size": 10240, "vocab_size": 262144, "sliding_window": 512,
               "max_position_embeddings": 131072, "hidden_size_per_layer_input": 256,
               "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": 18,
               "final_logit_softcapping": 30.0, "layer_types": _gemma4_layers(42),
               "rope_parameters": _GEMMA4_ROPE}
_GEMMA4_31B = {"hidden_size": 5376, "num_hidden_layers": 60, "num_attention_heads": 32,
               "num_key_value_heads": 16, "num_global_key_value_heads": 4, "head_dim": 256,
               "global_head_dim": 512, "attention_k_eq_v": True, "intermediate_size": 21504,
               "vocab_size": 262144, "sliding_window": 1024, "max_position_embeddings": 262144,
               "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
               "final_logit_softcapping": 30.0, "layer_types": _gemma4_layers(60),
               "rope_parameters": _GEMMA4_ROPE}
# google/gemma-4-{E4B,31B}-it-assistant: four layers reading the target's keys and values
_ASSISTANT_TEXT = {"num_hidden_layers": 4, "head_dim": 256, "global_head_dim": 512,
                   "vocab_size": 262144, "num_kv_shared_layers": 4,
                   "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                   "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
                   "rope_parameters": _GEMMA4_ROPE}
_E4B_ASSISTANT = {"backbone_hidden_size": 2560, "use_ordered_embeddings": True,
                  "text": {**_ASSISTANT_TEXT, "hidden_size": 256, "intermediate_size": 2048,
                           "num_attention_heads": 4, "num_key_value_heads": 2,
                           "sliding_window": 512, "max_position_embeddings": 131072}}
_31B_ASSISTANT = {"backbone_hidden_size": 5376, "use_ordered_embeddings": False,
                  "text": {**_ASSISTANT_TEXT, "hidden_size": 1024, "intermediate_size": 8192,
                           "num_attention_heads": 32, "num_key_value_heads": 16,
                           "num_global_key_value_heads": 4, "attention_k_eq_v": True,
                           "sliding_window": 1024, "max_position_embeddings": 262144}}
_GPT_OSS_20B = {"num_hidden_layers": 24, "num_local_experts": 32, "num_experts_per_tok": 4,
                "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
                "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
                "max_position_embeddings": 131072, "sliding_window": 128,
                "tie_word_embeddings": False}


def _meta(config: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _mtp_layer(config_class: Any, config: dict[str, Any]) -> int:
    """A Qwen3.5 MTP layer (transformers drops it): one full-attention decoder layer of the
    text model, fc 2 x hidden -> hidden, and three norms (pre_fc_norm_embedding,
    pre_fc_norm_hidden, norm)."""
    one = _meta(config_class(**{**config, "num_hidden_layers": 1,
                                "layer_types": ["full_attention"]}))
    hidden = config["hidden_size"]
    return _numel(one.model.layers[0]) + 2 * hidden * hidden + 3 * hidden


def qwen36_35b_a3b() -> dict[str, int]:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    text = _numel(_meta(Qwen3_5MoeTextConfig(**_QWEN36_35B)))
    mtp = _mtp_layer(Qwen3_5MoeTextConfig, _QWEN36_35B)
    return {"text": text, "mtp": mtp, "params": text + mtp}


def qwen35_4b() -> dict[str, int]:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    text = _numel(_meta(Qwen3_5TextConfig(**_QWEN35_4B)))
    return {"text": text, "params": text}


def dflash_qwen35_4b() -> dict[str, int]:
    """The drafter's own weights: its Qwen3 layers and final norm (transformers' Qwen3 model
    without its embedding: the drafter reads the target's), fc from the eight captured target
    layers to its hidden size, and hidden_norm."""
    from transformers import Qwen3Config

    model = _meta(Qwen3Config(**_DFLASH_QWEN35_4B)).model
    hidden = _DFLASH_QWEN35_4B["hidden_size"]
    layers = _numel(model) - _numel(model.embed_tokens)
    fc = _DFLASH_TARGET_LAYERS * hidden * hidden
    return {"layers": layers, "fc": fc, "params": layers + fc + hidden}


def _gemma4(config: dict[str, Any]) -> dict[str, int]:
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    return {"params": _numel(_meta(Gemma4TextConfig(**config)))}


def _assistant(config: dict[str, Any]) -> dict[str, int]:
    from transformers.models.gemma4_assistant.configuration_gemma4_assistant import (
        Gemma4AssistantConfig,
    )

    outer = {k: v for k, v in config.items() if k != "text"}
    text = {"model_type": "gemma4_text", **config["text"]}
    return {"params": _numel(_meta(Gemma4AssistantConfig(text_config=text, **outer)))}


def gpt_oss_20b() -> dict[str, int]:
    """Every parameter, and the expert weights alone: gate_up_proj and down_proj of each
    layer's experts (their biases stay bf16 in the MXFP4 checkpoint, as the rest does)."""
    from transformers import GptOssConfig

    model = _meta(GptOssConfig(**_GPT_OSS_20B))
    experts = sum(p.numel() for name, p in model.named_parameters()
                  if ".experts." in name and not name.endswith("_bias"))
    return {"params": _numel(model), "expert_weights": experts}


COUNTS = {
    "qwen3.6-35b-a3b": qwen36_35b_a3b,
    "qwen3.5-4b": qwen35_4b,
    "dflash-qwen3.5-4b": dflash_qwen35_4b,
    "gemma-4-e4b": lambda: _gemma4(_GEMMA4_E4B),
    "gemma-4-31b": lambda: _gemma4(_GEMMA4_31B),
    "gemma-4-e4b-assistant": lambda: _assistant(_E4B_ASSISTANT),
    "gemma-4-31b-assistant": lambda: _assistant(_31B_ASSISTANT),
    "gpt-oss-20b": gpt_oss_20b,
}


def main(argv: list[str]) -> int:
    for model_id in argv or list(COUNTS):
        counts = COUNTS[model_id]()
        print(model_id, " ".join(f"{k}={v:,}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
