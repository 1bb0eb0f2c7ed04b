"""Tiny random fp32 models of the families that keep more than a KV cache: hybrid recurrent
targets (Gated DeltaNet or Mamba-2 layers beside full attention) and sliding-window targets,
built from transformers 5 configs, with tests/tiny.py's tokenizer.

Knows: each family's config fields at a tiny size. Must not know: sessions, drafting.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM  # noqa: E402

from backends.torch.backend import TorchModel  # noqa: E402
from tests.tiny import VOCAB, tiny_tokenizer  # noqa: E402

WINDOW = 8  # the tiny sliding window: prompt and reply in the tests run past it
_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
           "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0, "tie_word_embeddings": False}
_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}


def _qwen3_5() -> Any:
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(**_COMMON, **_LINEAR, intermediate_size=64, num_hidden_layers=4,
                             layer_types=["linear_attention"] * 3 + ["full_attention"])


def _qwen3_5_moe() -> Any:
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(**_COMMON, **_LINEAR, num_hidden_layers=4,
                                layer_types=["linear_attention"] * 3 + ["full_attention"],
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                shared_expert_intermediate_size=16)


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(**_COMMON, **_LINEAR, intermediate_size=64, num_hidden_layers=4,
                           layer_types=["linear_attention", "full_attention"] * 2,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           shared_expert_intermediate_size=16)


def _nemotron_h() -> Any:
    from transformers import NemotronHConfig
    common = {k: v for k, v in _COMMON.items() if k != "num_hidden_layers"}
    return NemotronHConfig(**common, intermediate_size=64, layers_block_type=[
        "mamba", "attention", "mamba", "mlp"], ssm_state_size=8, mamba_num_heads=4,
        mamba_head_dim=8, n_groups=1, conv_kernel=4, expand=1, chunk_size=16,
        use_mamba_kernels=False)


def _falcon_h1() -> Any:
    from transformers import FalconH1Config
    return FalconH1Config(**_COMMON, intermediate_size=64, num_hidden_layers=3, mamba_d_ssm=32,
                          mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8,
                          mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16)


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig
    return Gemma3TextConfig(**_COMMON, intermediate_size=64, num_hidden_layers=4,
                            sliding_window=WINDOW, query_pre_attn_scalar=8,
                            layer_types=["sliding_attention"] * 3 + ["full_attention"])


def _mistral() -> Any:
    from transformers import MistralConfig
    return MistralConfig(**_COMMON, intermediate_size=64, num_hidden_layers=2,
                         sliding_window=WINDOW)


def _gpt_oss() -> Any:
    from transformers import GptOssConfig
    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 8}
    return GptOssConfig(**_COMMON, intermediate_size=32, num_hidden_layers=2,
                        sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                        layer_types=["sliding_attention", "full_attention"],
                        rope_parameters=yarn)


CONFIGS = {"qwen3_5_text": _qwen3_5, "qwen3_5_moe_text": _qwen3_5_moe, "qwen3_next": _qwen3_next,
           "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1, "gemma3_text": _gemma3,
           "mistral": _mistral, "gpt_oss": _gpt_oss}
RECURRENT = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h", "falcon_h1")
WINDOWED = ("gemma3_text", "mistral", "gpt_oss")


def tiny_family(family: str, seed: int = 1, attention: str | None = None) -> TorchModel:
    """A tiny random model of family (a key of CONFIGS); attention: an attn_implementation
    (the torch backend's row-wise one on CPU, as its load gives)."""
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    if attention:
        config._attn_implementation = attention
    hf = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # sharper logits make random models produce varied, non-trivial greedy sequences
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
        for name, weight in hf.named_parameters():
            if name.endswith("sinks"):  # gpt-oss's: drawn large enough to matter
                weight.normal_(0.0, 1.0)
    return TorchModel(hf, tiny_tokenizer(), name=f"tiny-{family}-{seed}", device="cpu")
