"""Tiny Qwen3.5 (qwen35), Qwen3.5-MoE (qwen35moe) and Qwen3-Next (qwen3next) GGUFs written in
llama.cpp's own convention, from tiny random models.

Knows: what llama.cpp's converter (convert_hf_to_gguf.py: Qwen3_5TextModel and
Qwen3_5MoeTextModel over the value-head reorder base, itself over Qwen3NextModel over
Qwen2MoeModel) writes for these text models: the gguf package's tensor names, value heads moved
from grouped-by-key-head to tiled order (the Qwen3.5 classes only), A as -exp(A_log), dt_bias as
ssm_dt.bias, conv kernels squeezed, the (1 + w) norms stored with their one added, Qwen3-Next's
per-key-head in_proj_qkvz split into all-heads q, k, v (attn_qkv) and z (attn_gate), the fused
experts split into 3-D gate, up and down tensors, 1-D tensors, conv kernels and routers in F32,
and the metadata keys it sets; a small byte-level vocabulary as tokenizer.ggml.*. Must not
know: specdeck's reader (backends/torch/qwen35_layout.py, gguf_model.py), so a test compares
two independent readings of one convention (and llama.cpp, where it is installed, a third).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gguf import (  # noqa: E402
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    dequantize,
    get_tensor_name_map,
    quants,
)
from transformers import AutoModelForCausalLM  # noqa: E402

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import Done, SamplingParams  # noqa: E402
from backends.torch.backend import TorchBackend, TorchModel  # noqa: E402
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
# transformers' text model type -> the GGUF architecture its converter writes
ARCHITECTURES = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe",
                 "qwen3_next": "qwen3next"}
# the pre-tokenizer each converter names for Qwen's vocabulary
PRE_TOKENIZERS = {"qwen35": "qwen35", "qwen35moe": "qwen35", "qwen3next": "qwen2"}
# kept F32 whatever the file type: llama.cpp's converter never quantizes a router
F32_MATRICES = (".ffn_gate_inp.", ".ffn_gate_inp_shexp.", ".ssm_conv1d.")


_LLAMA_CPP = """
import json, sys
from llama_cpp import Llama
path, prompt, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(path, n_ctx=128, n_batch=128, logits_all=True, n_threads=1, verbose=False)
llm.eval(prompt)
logits = [list(map(float, row)) for row in llm.scores[:len(prompt)]]
tokens = []
for _ in range(new):
    tokens.append(int(llm.scores[llm.n_tokens - 1].argmax()))
    llm.eval(tokens[-1:])
print(json.dumps({"logits": logits, "tokens": tokens}))
"""


def llama_cpp_run(path: Path, prompt: list[int], new: int) -> dict:
    """llama.cpp's own loader and graph on a file: every prompt position's logits and `new`
    greedy tokens (in a child, as a ggml assert aborts)."""
    run = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(path), json.dumps(prompt),
                          str(new)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def load_files(files: dict[int, Path]) -> dict[int, TorchModel]:
    """Each written file loaded on its own blocks, decoding every new token it is asked for."""
    loaded = {kind: TorchBackend().load(str(path), device="cpu", dtype="gguf")
              for kind, path in files.items()}
    for model in loaded.values():
        model.eos_token_ids = frozenset()  # every run decodes the tokens asked
    return loaded


def logits(model: TorchModel, ids: list[int]) -> torch.Tensor:
    """Every position's logits from the model's own forward."""
    with torch.no_grad():
        return model.hf(torch.tensor([ids])).logits[0]


def decoded(model: TorchModel, prompt: list[int], new: int, drafter=None, k: int = 0) -> Done:
    """The engine's finished greedy generation of `new` tokens after `prompt`."""
    done = list(SpecEngine(model).generate(prompt, SamplingParams(max_new_tokens=new),
                                           drafter=drafter, k=k))[-1]
    assert isinstance(done, Done) and done.error is None, done
    return done


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


def tiny_moe(family: str, seed: int = 1, width: int = 32) -> TorchModel:
    """tests/tiny_families.py's tiny Qwen3.5-MoE (`qwen3_5_moe_text`, M-RoPE as tiny_qwen35's)
    or Qwen3-Next (`qwen3_next`, NeoX rotary on a quarter of each head), with norms, A_log and
    dt_bias drawn as tiny_qwen35 draws them, and routers drawn wide (std 1) so that each row's
    top 2 of 4 experts are clear choices, not near ties a rounding could swap. The experts
    are `width` wide (32 by default, so that their down matrices' rows split into Q8_0's
    blocks of 32), the hidden state too where width is given (256: K-quants' blocks)."""
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    config.head_dim = 16
    config.moe_intermediate_size = config.shared_expert_intermediate_size = width
    if width != 32:
        config.hidden_size = width
    if family == "qwen3_5_moe_text":
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                  "mrope_interleaved": True}
    hf = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
        for name, value in hf.named_parameters():
            if name.endswith(("norm.weight", ".A_log", ".dt_bias")):
                value.normal_(0.0, 0.3)
            elif name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight")):
                value.normal_(0.0, 1.0)
    return TorchModel(hf, tiny_tokenizer(), name=f"tiny-{family}-{seed}", device="cpu")


def moe_twin(model: TorchModel, kind: int) -> TorchModel:
    """The same model with every matrix save_qwen35_gguf quantizes (all 2-D and 3-D weights
    but the routers and the shared experts' gates) replaced by its `kind` values, in float32."""
    hf = copy.deepcopy(model.hf)
    kind_type = GGMLQuantizationType(kind)
    with torch.no_grad():
        for name, value in hf.named_parameters():
            if value.ndim < 2 or name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight",
                                                 ".conv1d.weight")):
                continue
            stored = quants.quantize(value.float().numpy(), kind_type)
            values = dequantize(stored, kind_type).reshape(value.shape)
            value.copy_(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)))
    return TorchModel(hf, model.tokenizer, name=f"{model.name}-{kind_type.name}", device="cpu")


def vocabulary() -> list[str]:
    return SPECIALS + SINGLES + [merge.replace(" ", "") for merge in MERGES]


def save_qwen35_gguf(model: TorchModel, path: Path, kind: int = F32,
                     fused_experts: bool = False) -> Path:
    """model's weights as llama.cpp's converter writes them, its matrices as `kind` (F32,
    F16 or a type the gguf package quantizes). fused_experts: each layer's experts' gate and
    up as one ffn_gate_up_exps tensor, as transformers holds them (the gguf package's
    FFN_GATE_UP_EXP, which both architectures' tensor lists name), not split in two."""
    config = model.hf.config
    architecture = ARCHITECTURES[config.model_type]
    writer = GGUFWriter(str(path), architecture)
    _write_metadata(writer, config, kind)
    _write_vocabulary(writer, PRE_TOKENIZERS[architecture])
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    table = get_tensor_name_map(arch, int(config.num_hidden_layers))
    for name, value in model.hf.state_dict().items():
        converted = ([(f"{name}.weight", value.float().numpy())]
                     if fused_experts and name.endswith(".experts.gate_up_proj")
                     else _converted(name, value.float().numpy(), config, architecture))
        for stored_name, stored in converted:
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
    if getattr(config, "intermediate_size", None) is not None:
        write_shape(writer, config)
    else:  # an all-expert model: the converter writes no dense FFN width
        _write_shape_without_ffn(writer, config)
    if getattr(config, "num_experts", 0):
        _write_experts(writer, config)
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
    if config.model_type == "qwen3_next":
        return  # NeoX rotary: Qwen3NextModel writes no sections
    sections = rope.get("mrope_section")
    writer.add_rope_dimension_sections(DEFAULT_SECTIONS if sections is None
                                       else [*sections, 0, 0, 0, 0][:4])


def _write_shape_without_ffn(writer: GGUFWriter, config) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _write_experts(writer: GGUFWriter, config) -> None:
    """The keys TextModel and Qwen2MoeModel set from a MoE config."""
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "norm_topk_prob", None) is not None:
        writer.add_expert_weights_norm(config.norm_topk_prob)


def _interval(layer_types: list[str]) -> int:
    """The converter writes one full-attention period; the layers must follow it."""
    interval = layer_types.index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(len(layer_types))]
    assert layer_types == expected, layer_types
    return interval


def _write_vocabulary(writer: GGUFWriter, pre: str) -> None:
    tokens = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in SPECIALS else NORMAL for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)


def _converted(name: str, value: np.ndarray, config,
               architecture: str) -> list[tuple[str, np.ndarray]]:
    """(HF-side name the converter maps, values as it stores them) for each tensor the
    converter writes from one parameter."""
    if name.endswith(".experts.gate_up_proj"):
        gate, up = np.split(value, 2, axis=1)  # HF [experts, 2 * ff, d]: gate rows first
        stem = name.removesuffix(".gate_up_proj")
        return [(f"{stem}.gate_proj.weight", gate), (f"{stem}.up_proj.weight", up)]
    if name.endswith(".experts.down_proj"):
        return [(f"{name}.weight", value)]
    if name.endswith(".linear_attn.in_proj_qkvz.weight"):
        return _split_qkvz(name, value, config)
    if architecture != "qwen3next":
        value = _tiled(name, value, config)
    return [_stored(name, value)]


def _split_qkvz(name: str, value: np.ndarray, config) -> list[tuple[str, np.ndarray]]:
    """Qwen3-Next's rows per key head [q, k, v, z] as all heads' q, k, v (attn_qkv) and z
    (attn_gate)."""
    k_heads, k_dim = int(config.linear_num_key_heads), int(config.linear_key_head_dim)
    per_head_v = int(config.linear_num_value_heads) // k_heads * int(config.linear_value_head_dim)
    grouped = value.reshape(k_heads, 2 * k_dim + 2 * per_head_v, -1)
    q, k, v, z = np.split(grouped, np.cumsum([k_dim, k_dim, per_head_v]), axis=1)
    stem = name.removesuffix(".in_proj_qkvz.weight")
    flat = [part.reshape(-1, value.shape[1]) for part in (q, k, v, z)]
    return [(f"{stem}.in_proj_qkv.weight", np.concatenate(flat[:3])),
            (f"{stem}.in_proj_z.weight", flat[3])]


def _stored(name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """The converter's value transforms shared by all three families."""
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
    if value.ndim == 1 or any(part in name for part in F32_MATRICES) or kind == F32:
        writer.add_tensor(name, value)
    elif kind == F16:
        writer.add_tensor(name, value.astype(np.float16))
    else:
        kind_type = GGMLQuantizationType(kind)
        writer.add_tensor(name, quants.quantize(value, kind_type), raw_dtype=kind_type)
