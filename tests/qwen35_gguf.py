"""A tiny Qwen3.5 (qwen35) GGUF written in llama.cpp's own convention, from a tiny random model.

Knows: what llama.cpp's converter (convert_hf_to_gguf.py: Qwen3_5TextModel over the Qwen3-Next
class and the value-head reorder base it builds on) writes for a dense Qwen3.5 text model: the
gguf package's tensor names, value heads moved from grouped-by-key-head to tiled order, A as
-exp(A_log), dt_bias as ssm_dt.bias, conv kernels squeezed, the (1 + w) norms stored with their
one added, 1-D tensors and conv kernels in F32, and the metadata keys it sets; a small
byte-level vocabulary as tokenizer.ggml.*. Must not know: specdeck's reader
(backends/torch/qwen35_layout.py), so a test compares two independent readings of one
convention (and llama.cpp, where it is installed, a third).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gguf import (  # noqa: E402
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    get_tensor_name_map,
    quants,
)
from transformers import AutoModelForCausalLM  # noqa: E402

from backends.torch.backend import TorchModel  # noqa: E402
from tests.tiny import tiny_tokenizer, write_shape  # noqa: E402
from tests.tiny_families import CONFIGS  # noqa: E402

F32, F16 = int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16)
_FILE_TYPES = {F32: LlamaFileType.ALL_F32, F16: LlamaFileType.MOSTLY_F16,
               int(GGMLQuantizationType.Q8_0): LlamaFileType.MOSTLY_Q8_0}
# the converter's default when a checkpoint's rope_parameters carry no mrope_section
DEFAULT_SECTIONS = [11, 11, 10, 0]
# ids 0 and 1 are the tiny configs' bos/pad and eos; then single letters and digits, then
# tokens the merges build (so the file's merges are real ones)
SPECIALS = ["<|im_start|>", "<|endoftext|>"]
SINGLES = list("abcdefghijklmnopqrstuvwxyz0123456789")
MERGES = ["a b", "c d", "e f", "g h", "i j", "k l", "m n", "o p", "q r", "s t"]
CONTROL, NORMAL = 3, 1


def tiny_qwen35(seed: int = 1) -> TorchModel:
    """tests/tiny_families.py's tiny Qwen3.5 with Qwen3.5's partial, interleaved M-RoPE as
    its checkpoints have it (three sections filling the rotary half: 8 of 16 dimensions
    rotated), and norms, A_log and dt_bias drawn away from their initial values so that
    every stored transform changes them."""
    torch.manual_seed(seed)
    config = CONFIGS["qwen3_5_text"]()
    config.head_dim = 16
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                              "mrope_interleaved": True}
    hf = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)  # varied greedy sequences, as tiny.py's
        for name, value in hf.named_parameters():
            if name.endswith(("norm.weight", ".A_log", ".dt_bias")):
                value.normal_(0.0, 0.3)
    return TorchModel(hf, tiny_tokenizer(), name=f"tiny-qwen35-{seed}", device="cpu")


def vocabulary() -> list[str]:
    return SPECIALS + SINGLES + [merge.replace(" ", "") for merge in MERGES]


def save_qwen35_gguf(model: TorchModel, path: Path, kind: int = F32) -> Path:
    """model's weights as llama.cpp's converter writes them, its matrices as `kind` (F32,
    F16 or a type the gguf package quantizes)."""
    config = model.hf.config
    writer = GGUFWriter(str(path), "qwen35")
    _write_metadata(writer, config, kind)
    _write_vocabulary(writer)
    table = get_tensor_name_map(MODEL_ARCH.QWEN35, int(config.num_hidden_layers))
    for name, value in model.hf.state_dict().items():
        stored_name, stored = _stored(name, value.float().numpy(), config)
        gguf_name = table.get_name(stored_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, stored_name
        _add(writer, gguf_name, stored, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: GGUFWriter, config, kind: int) -> None:
    head_dim = int(config.head_dim)
    rope = config.rope_parameters
    write_shape(writer, config)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(_FILE_TYPES[kind])
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_full_attention_interval(_interval(config.layer_types))
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    sections = rope.get("mrope_section")
    writer.add_rope_dimension_sections(DEFAULT_SECTIONS if sections is None
                                       else [*sections, 0, 0, 0, 0][:4])


def _interval(layer_types: list[str]) -> int:
    """The converter writes one full-attention period; the layers must follow it."""
    interval = layer_types.index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(len(layer_types))]
    assert layer_types == expected, layer_types
    return interval


def _write_vocabulary(writer: GGUFWriter) -> None:
    tokens = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in SPECIALS else NORMAL for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)


def _stored(name: str, value: np.ndarray, config) -> tuple[str, np.ndarray]:
    """(HF-side name the converter maps, values as it stores them) for one parameter."""
    value = _tiled(name, value, config)
    if name.endswith(".A_log"):
        value = -np.exp(value)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        value = value.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        value = value + np.float32(1.0)
    return name, value


def _tiled(name: str, value: np.ndarray, config) -> np.ndarray:
    """Value heads in llama.cpp's tiled order on every tensor with a value-head axis."""
    k_heads, v_heads = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    if k_heads == v_heads or "linear_attn." not in name:
        return value
    v_dim = int(config.linear_value_head_dim)
    qk_rows = 2 * int(config.linear_key_head_dim) * k_heads
    tile = lambda x, axis, dim: _grouped_to_tiled(x, axis, k_heads, v_heads // k_heads, dim)  # noqa: E731
    if ".in_proj_qkv." in name or ".conv1d." in name:
        return np.concatenate([value[:qk_rows], tile(value[qk_rows:], 0, v_dim)])
    if ".in_proj_z." in name:
        return tile(value, 0, v_dim)
    if ".in_proj_a." in name or ".in_proj_b." in name or name.endswith((".A_log", ".dt_bias")):
        return tile(value, 0, 1)
    if ".out_proj." in name:
        return tile(value, 1, v_dim)
    return value


def _grouped_to_tiled(x: np.ndarray, axis: int, k_heads: int, per_k: int,
                      dim: int) -> np.ndarray:
    shape = x.shape
    split = shape[:axis] + (k_heads, per_k, dim) + shape[axis + 1:]
    return np.ascontiguousarray(np.swapaxes(x.reshape(split), axis, axis + 1)).reshape(shape)


def _add(writer: GGUFWriter, name: str, value: np.ndarray, kind: int) -> None:
    value = np.ascontiguousarray(value, dtype=np.float32)
    if value.ndim == 1 or ".ssm_conv1d." in name or kind == F32:
        writer.add_tensor(name, value)
    elif kind == F16:
        writer.add_tensor(name, value.astype(np.float16))
    else:
        kind_type = GGMLQuantizationType(kind)
        writer.add_tensor(name, quants.quantize(value, kind_type), raw_dtype=kind_type)
