"""Tiny random fp32 models and their tokenizer, built from configs: no downloads, seconds to run.

Imports torch and transformers: tests/conftest.py reaches this module only from the fixtures
that build models, so numpy-only test modules collect and run without torch.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
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


def tiny_qwen3(seed: int, vocab: int = VOCAB, layers: int = 2, hidden: int = 64) -> TorchModel:
    """A tiny Qwen3: Llama's layout with each head's queries and keys normed before RoPE
    (norm weights drawn away from ones, so a norm on the wrong rows shows)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, max_position_embeddings=256, eos_token_id=1,
                         bos_token_id=0, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
        for name, weight in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                weight.uniform_(0.5, 1.5)
    return TorchModel(hf, tiny_tokenizer(vocab), name=f"tiny-qwen3-{seed}", device="cpu")


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


# the GGUF architecture llama.cpp's converter writes each model type as, and what it adds to
# every `*norm.weight` (convert_hf_to_gguf.py: Gemma3Model.norm_shift is 1.0, since
# Gemma3RMSNorm scales by 1 + w; MistralForCausalLM converts as a llama)
GGUF_ARCH = {"gemma3_text": "gemma3", "mistral": "llama"}
LLAMA_CPP_NORM_SHIFT = {"gemma3": 1.0}


def lean_and_reference(model: TorchModel) -> tuple[Any, Any]:
    """A session on a loaded model's lean forward and one on transformers' forward (the model
    keeps the latter afterwards)."""
    assert model.lean is not None
    lean = model.start()
    model.lean = None
    return lean, model.start()


def same_rows(sessions: tuple[Any, Any], ids: list[int], layers: tuple[int, ...],
              **kwargs: Any) -> None:
    """Both sessions forward ids: their logits and captured layers hold the same bits."""
    a, b = (s.forward(ids, capture=layers, **kwargs) for s in sessions)
    assert (a.host_logits() == b.host_logits()).all()
    for layer in layers:
        assert torch.equal(a.hidden_states[layer], b.hidden_states[layer])


def write_shape(writer: Any, config: Any) -> None:
    """The metadata keys of a decoder's shape, as llama.cpp's converter writes them."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def save_gguf(model: TorchModel, path: Path, kind: int) -> Path:
    """A tiny model's weights as a GGUF file in llama.cpp's convention (architecture, norm
    shift, a llama's query and key rows in its rotary order), its matrices quantized to
    `kind` (a legacy type the gguf package quantizes), norms in F32; its config and tokenizer
    go where the torch backend's first load would put them."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from backends.gguf import METADATA_SUFFIX, record_source
    from backends.torch.gguf_model import _qk_order

    hf, config = model.hf, model.hf.config
    architecture = GGUF_ARCH.get(config.model_type, config.model_type)
    shift = LLAMA_CPP_NORM_SHIFT.get(architecture, 0.0)
    writer = GGUFWriter(str(path), architecture)
    write_shape(writer, config)
    state = hf.state_dict()
    table = get_gguf_hf_weights_map(hf, TensorProcessor(), model_type=architecture)
    for gguf_name, hf_name in table.items():
        weight = state[hf_name].float().numpy()
        if hf_name.endswith("norm.weight"):
            weight = weight + shift
        order = _qk_order(gguf_name, config, architecture)
        if order is not None:
            stored = np.empty_like(weight)
            stored[order] = weight
            weight = stored
        if weight.ndim == 1:
            writer.add_tensor(gguf_name, weight)
        else:
            writer.add_tensor(gguf_name, quants.quantize(weight, GGMLQuantizationType(kind)),
                              raw_dtype=GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = path.with_name(path.name + METADATA_SUFFIX)
    save_hf_folder(model, folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()  # the metadata folder holds no weights
    record_source(path, folder)
    return path


def dequantized_twin(model: TorchModel, kind: int) -> TorchModel:
    """The same tiny model with each matrix replaced by its `kind` values, in float32."""
    from gguf import GGMLQuantizationType, dequantize, quants

    hf = copy.deepcopy(model.hf)
    with torch.no_grad():
        for module in hf.modules():
            weight = getattr(module, "weight", None)
            if weight is not None and weight.ndim == 2:
                q = quants.quantize(weight.float().numpy(), GGMLQuantizationType(kind))
                values = dequantize(q, GGMLQuantizationType(kind)).reshape(weight.shape)
                weight.copy_(torch.from_numpy(np.ascontiguousarray(values)))
    return TorchModel(hf, model.tokenizer, name=f"{model.name}-dequantized", device="cpu")
