"""Tiny random fp32 models and their tokenizer, built from configs: no downloads, seconds to run.

Imports torch and transformers: tests/conftest.py reaches this module only from the fixtures
that build models, so numpy-only test modules collect and run without torch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from backends.torch import w4a8  # noqa: E402
from backends.torch.backend import TorchModel  # noqa: E402

VOCAB = 48
# w4a8 runs where its kernel builds (AVX512-VNNI and a C compiler) and passes its row check
W4A8 = pytest.param("w4a8", marks=pytest.mark.skipif(
    not w4a8.is_exact(), reason=f"w4a8 cannot run here: {w4a8.unavailable_reason()}"))


def tiny_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    words = {f"w{i}": i for i in range(vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", eos_token="w1")


def tiny_llama(seed: int, vocab: int = VOCAB, layers: int = 2, hidden: int = 32) -> TorchModel:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=1, bos_token_id=0)
    hf = LlamaForCausalLM(config).to(torch.float32)
    # sharper logits make random models produce varied, non-trivial greedy sequences
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    return TorchModel(hf, tiny_tokenizer(vocab), name=f"tiny-llama-{seed}", device="cpu")


def save_hf_folder(model: TorchModel, folder: Path) -> Path:
    """A torch model's weights, config and tokenizer as an HF folder any backend can load."""
    model.hf.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    return folder


def mlx_twin(model: TorchModel, folder: Path):
    """The same weights loaded by the MLX backend (fp32 on the CPU); skips without mlx-lm."""
    pytest.importorskip("mlx_lm")
    from backends.mlx.backend import MlxBackend
    return MlxBackend().load(str(save_hf_folder(model, folder)), device="cpu", dtype="float32")
