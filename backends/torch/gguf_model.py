"""A transformers model whose weights are a GGUF file's own tensors, computed by ggml.

Knows: the gguf package's tensor name table (gguf tensor name <-> HF parameter name), the fused
projection layout of fuse.py, llama.cpp's row order for LLaMA's query and key weights, which
architectures store values transformed (qwen35's, qwen35moe's and qwen3next's, undone by
qwen35_layout.py; the families whose layout no layer here maps, none now, and what loads them
instead), where an MoE block's experts lie (each expert's slice of a 3-D tensor, computed by
gguf_experts.py), the layers of gguf_layers.py and which kernel takes a tensor. Must not
know: sessions, drafting, dtypes other than the file's own.

The model is built on the meta device from the GGUF's config, then each MoE block's experts
and router become a GgufExperts and a GgufRouter, each linear layer a GgufLinear (kquant's
tiles repacked from the file's blocks, or ggml on the memory-mapped blocks themselves), the
embedding a GgufEmbedding on the mapped table, and the few small tensors left (norms,
biases: F32 in the file) are read as float32. Nothing the size of the weights is allocated,
dequantized or written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, dequantize, get_tensor_name_map
from gguf.constants import GGMLQuantizationType
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from app.core.types import SpecdeckError
from backends.gguf import metadata_folder
from backends.gguf_header import architecture
from backends.gguf_tensors import GgufTensors, TensorInfo, open_tensors
from backends.torch import ggml, kquant, qwen35_layout
from backends.torch.fuse import GROUPS, FusedProjection, ProjectionSlice
from backends.torch.gguf_experts import GgufExperts, GgufRouter
from backends.torch.gguf_layers import GgufEmbedding, GgufLinear, Part

# GGUF architectures whose converter permuted query and key rows for llama.cpp's rotary
# layout (convert_hf_to_gguf's LLaMA permute; transformers' LlamaTensorProcessor undoes it)
PERMUTED_QK = frozenset({"llama"})
# families whose stored layout no layer here maps: why not, and what loads them (none now:
# qwen35, qwen35moe and qwen3next map through qwen35_layout.py and gguf_experts.py)
UNMAPPED: dict[str, tuple[str, str]] = {}


def blocks_reason(architecture: str | None) -> str | None:
    """Why a GGUF of this architecture cannot compute on its own blocks here, or None."""
    if architecture in UNMAPPED:
        return UNMAPPED[architecture][0].format(architecture)
    return None


def blocks_route(architecture: str | None) -> str:
    """What loads a GGUF whose blocks this path refuses."""
    if architecture in UNMAPPED:
        return UNMAPPED[architecture][1]
    return "use --dtype auto (transformers reads it into memory) or the safetensors checkpoint"


def unavailable_reason() -> str | None:
    """Why no kernel here computes on GGUF blocks, or None."""
    if kquant.is_available() or ggml.is_available():
        return None
    return ("this CPU lacks AVX-512 VNNI and AVX2 (specdeck's kernel) and "
            f"{ggml.unavailable_reason()}")


def load_gguf_model(path: Path, attn_implementation: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of a .gguf whose linear layers compute on the file's blocks."""
    arch = architecture(path)
    reason = blocks_reason(arch)
    if reason is not None:
        raise SpecdeckError(f"--dtype gguf cannot run {path.name}: {reason}; "
                            f"{blocks_route(arch)}")
    folder = metadata_folder(path)
    config = AutoConfig.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tensors = open_tensors(path)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
    table = _name_table(hf, tensors)
    names = _hf_names(hf, tensors, table)
    _attach_experts(hf, tensors, names, table)
    _attach_linears(hf, tensors, names, table)
    _attach_rest(hf, tensors, names)
    hf.gguf_tensors = tensors  # the map stays open as long as the model lives
    return hf.eval(), tokenizer


def stored_bytes(hf: Any) -> int:
    """Bytes of the file's tensors the model computes on (each tensor counted once)."""
    seen: dict[int, int] = {}
    for module in hf.modules():
        for key, size in _stored(module):
            seen[key] = size
    return sum(seen.values())


def _stored(module: torch.nn.Module) -> list[tuple[int, int]]:
    """(address, bytes) of what a layer keeps: its kquant tiles, or the file's blocks."""
    if isinstance(module, GgufLinear):
        return [(id(p.packed), p.packed.nbytes) if p.packed is not None
                else (p.data.ctypes.data, p.data.nbytes) for p in module.parts]
    if isinstance(module, GgufEmbedding):
        return [(module.data.ctypes.data, module.data.nbytes)]
    return []


def _name_table(hf: Any, tensors: GgufTensors) -> Any:
    """The gguf package's name table for the file's architecture, built once: transformers'
    own walk builds it again for every submodule, 8 of the 0.5B Qwen's 16 s of loading."""
    arch = next((key for key, value in MODEL_ARCH_NAMES.items()
                 if value == tensors.architecture), None)
    if arch is None:
        raise SpecdeckError(f"{tensors.path.name}: the gguf package does not know its "
                            f"architecture {tensors.architecture!r}")
    return get_tensor_name_map(arch, int(hf.config.num_hidden_layers))


def _hf_names(hf: Any, tensors: GgufTensors, table: Any) -> dict[str, str]:
    """HF parameter name -> GGUF tensor name, for every tensor the file holds."""
    names = {}
    for hf_name in hf.state_dict():
        gguf = _gguf_name(table, tensors, hf_name)
        if gguf is not None:
            names[hf_name] = gguf
    head = hf.get_output_embeddings()
    head_name = next(n for n, m in hf.named_modules() if m is head) + ".weight"
    if head_name not in names and "token_embd.weight" in tensors.infos:
        names[head_name] = "token_embd.weight"  # tied: the output layer reads the embedding
    return names


def _gguf_name(table: Any, tensors: GgufTensors, hf_name: str) -> str | None:
    """The stored name of a parameter, as the converter named it: its module mapped and its
    leaf kept, else the whole name mapped (qwen35's A_log is stored as blk.N.ssm_a)."""
    if tensors.architecture in qwen35_layout.ARCHITECTURES:
        hf_name = qwen35_layout.converter_name(hf_name)
    stem, dot, suffix = hf_name.rpartition(".")
    module = table.get_name(stem) if dot else None
    if module is not None and f"{module}.{suffix}" in tensors.infos:
        return f"{module}.{suffix}"
    whole = table.get_name(hf_name)
    return whole if whole in tensors.infos else None


def _attach_linears(hf: Any, tensors: GgufTensors, names: dict[str, str], table: Any) -> None:
    """Every nn.Linear becomes a GgufLinear; q/k/v and gate/up become one fused layer each."""
    prefix = {m: n for n, m in hf.named_modules()}
    for module in list(hf.modules()):
        _fuse_groups(module, prefix[module], hf.config, tensors, names)
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                name = _join(prefix[module], child_name)
                setattr(module, child_name, _linear(name, hf.config, tensors, names, table))


def _linear(name: str, config: Any, tensors: GgufTensors, names: dict[str, str],
            table: Any) -> GgufLinear:
    """The GgufLinear of one nn.Linear: its stored tensor, or the tensors the converter split
    it into, read back in HF row order."""
    joined = (qwen35_layout.joined_rows(f"{name}.weight", config)
              if tensors.architecture in qwen35_layout.ARCHITECTURES else None)
    if joined is None:
        return GgufLinear([_part(name, config, tensors, names)],
                          _input_order(name, config, tensors.architecture))
    stored, order = joined
    parts = []
    for converter_name in stored:
        gguf_name = f"{table.get_name(converter_name)}.weight"
        if gguf_name not in tensors.infos:
            raise SpecdeckError(f"{tensors.path.name} has no tensor {gguf_name} for {name}: "
                                "the file does not match its own config; download it again")
        parts.append(_stored_part(tensors, tensors.infos[gguf_name], None, None))
    return GgufLinear(parts, output_order=order)


def _fuse_groups(module: torch.nn.Module, name: str, config: Any, tensors: GgufTensors,
                 names: dict[str, str]) -> None:
    for fused_name, group in GROUPS:
        layers = [getattr(module, child, None) for child in group]
        if not all(isinstance(layer, torch.nn.Linear) for layer in layers):
            continue
        parts = [_part(_join(name, child), config, tensors, names) for child in group]
        fused = FusedProjection(GgufLinear(parts), [p.out_features for p in parts])
        module.add_module(fused_name, fused)
        for index, child in enumerate(group):
            setattr(module, child, ProjectionSlice(fused, index))


def _part(name: str, config: Any, tensors: GgufTensors, names: dict[str, str]) -> Part:
    weight = names.get(f"{name}.weight")
    if weight is None:
        raise SpecdeckError(f"{tensors.path.name} has no tensor for {name}: the file does not "
                            "match its own config; download it again")
    order = _row_order(name, weight, config, tensors.architecture)
    bias_name = names.get(f"{name}.bias")
    bias = None if bias_name is None else _float(tensors, bias_name)
    if bias is not None and order is not None:
        bias = bias[torch.from_numpy(order).long()]
    return _stored_part(tensors, tensors.infos[weight], order, bias)


def _stored_part(tensors: GgufTensors, info: TensorInfo, order: np.ndarray | None,
                 bias: torch.Tensor | None) -> Part:
    """A Part over the stored matrix `info` (a whole tensor, or one expert's slice of one)."""
    packed = _packed(tensors, info, order)
    if packed is None and not ggml.can_compute(info.ggml_type):
        why = ggml.unavailable_reason() or f"ggml has no CPU kernel for {info.type_name}"
        raise SpecdeckError(f"{tensors.path.name}: {info.name} is {info.type_name}, which "
                            f"specdeck's own kernel does not compute on this CPU, and {why}")
    data = tensors.data[info.offset:info.offset + info.nbytes]
    part = Part(data, info, order, bias, packed)
    part.path = tensors.path
    return part


def _packed(tensors: GgufTensors, info: TensorInfo, order: np.ndarray | None) -> np.ndarray | None:
    """kquant's tiles of a Q4_K / Q6_K matrix, rows in HF order; None where ggml computes it.
    The bytes are read, not mapped, so the file's pages do not stay in this process too."""
    if not kquant.can_take(info.ggml_type, info.rows, info.row_length):
        return None
    with tensors.path.open("rb") as f:
        stored = np.frombuffer(os.pread(f.fileno(), info.nbytes, info.offset), np.uint8)
    if order is not None:
        stored = stored.reshape(info.rows, -1)[order]
    return kquant.pack(info.ggml_type, stored, info.rows, info.row_length)


def _attach_experts(hf: Any, tensors: GgufTensors, names: dict[str, str], table: Any) -> None:
    """Each MoE block's fused experts module becomes a GgufExperts over the file's 3-D expert
    tensors (one GgufLinear per expert's slice) and its router a GgufRouter over the stored
    router matrix; the shared expert and its gate are linear layers, left to _attach_linears."""
    for name, block in list(hf.named_modules()):
        experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
        if not _fused_experts(experts):
            continue
        prefix = _join(name, "experts")
        gate_up = _expert_layers(tensors, table, prefix, [("gate_up_proj",),
                                                          ("gate_proj", "up_proj")])
        down = _expert_layers(tensors, table, prefix, [("down_proj",)])
        _check_experts(tensors, prefix, experts, gate_up, down)
        block.experts = GgufExperts(gate_up, down, experts.act_fn)
        logits = GgufLinear([_part(_join(name, "gate"), hf.config, tensors, names)])
        # Qwen3.5-MoE's router always renormalizes its top k; Qwen3-Next's says whether
        block.gate = GgufRouter(logits, int(router.top_k),
                                bool(getattr(router, "norm_topk_prob", True)))


def _fused_experts(module: Any) -> bool:
    """transformers 5's experts module: every expert's gate/up and down in one 3-D parameter."""
    return all(isinstance(getattr(module, leaf, None), torch.nn.Parameter)
               and getattr(module, leaf).dim() == 3 for leaf in ("gate_up_proj", "down_proj"))


def _expert_layers(tensors: GgufTensors, table: Any, prefix: str,
                   layouts: list[tuple[str, ...]]) -> list[GgufLinear]:
    """One GgufLinear per expert, its parts the expert's slices of the first layout's tensors
    the file holds (a converter writes gate and up apart, or as one gate_up tensor)."""
    for leaves in layouts:
        stored = [f"{table.get_name(f'{prefix}.{leaf}')}.weight" for leaf in leaves]
        if all(name in tensors.infos for name in stored):
            infos = [tensors.infos[name] for name in stored]
            count = infos[0].dims[-1]
            return [GgufLinear([_stored_part(tensors, _expert_slice(info, expert), None, None)
                                for info in infos]) for expert in range(count)]
    raise SpecdeckError(f"{tensors.path.name} has no expert tensors for {prefix} (looked for "
                        f"{', '.join('+'.join(leaves) for leaves in layouts)}): the file does "
                        "not match its own config; download it again")


def _expert_slice(info: TensorInfo, expert: int) -> TensorInfo:
    """One expert's matrix inside a 3-D tensor [experts, rows, cols]: ggml keeps the experts
    outermost, so each is whole rows of whole blocks, contiguous in the file."""
    if len(info.dims) != 3:
        raise SpecdeckError(f"{info.name} has {len(info.dims)} dimensions; an experts tensor "
                            "has 3")
    size = info.nbytes // info.dims[2]
    return TensorInfo(f"{info.name}[{expert}]", info.ggml_type, info.dims[:2],
                      info.offset + expert * size, size)


def _check_experts(tensors: GgufTensors, prefix: str, experts: Any, gate_up: list[GgufLinear],
                   down: list[GgufLinear]) -> None:
    """The stored experts have the shapes the config gives the module's parameters."""
    count, rows, width = experts.gate_up_proj.shape
    down_shape = tuple(experts.down_proj.shape)
    stored = (len(gate_up), gate_up[0].out_features, gate_up[0].in_features)
    stored_down = (len(down), down[0].out_features, down[0].in_features)
    if stored != (count, rows, width) or stored_down != down_shape:
        raise SpecdeckError(f"{tensors.path.name}: {prefix} is stored as {stored} and "
                            f"{stored_down}, its config wants {(count, rows, width)} and "
                            f"{down_shape}; the file does not match its own config")


def _row_order(name: str, gguf_name: str, config: Any, architecture: str) -> np.ndarray | None:
    """The stored row each HF row of a weight is, where the converter moved rows; else None."""
    if architecture in qwen35_layout.ARCHITECTURES:
        return qwen35_layout.row_order(f"{name}.weight", config)
    return _qk_order(gguf_name, config, architecture)


def _input_order(name: str, config: Any, architecture: str) -> np.ndarray | None:
    """Which input each stored column reads, where the converter moved columns; else None."""
    if architecture in qwen35_layout.ARCHITECTURES:
        return qwen35_layout.input_order(f"{name}.weight", config)
    return None


def _qk_order(gguf_name: str, config: Any, architecture: str) -> np.ndarray | None:
    """For LLaMA's query and key weights, the stored row each HF row is: the converter
    interleaved each head's two rotary halves (row h, s, j went to h, j, s)."""
    if architecture not in PERMUTED_QK:
        return None
    if ".attn_q." in gguf_name:
        heads = int(config.num_attention_heads)
    elif ".attn_k." in gguf_name:
        heads = int(config.num_key_value_heads)
    else:
        return None
    head_dim = int(getattr(config, "head_dim", None)
                   or config.hidden_size // config.num_attention_heads)
    return np.arange(heads * head_dim).reshape(heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


# what llama.cpp's converter added to every `*norm.weight` of these families (their norms
# scale by 1 + w, stored as 1 + w so llama.cpp multiplies by it; Gemma 4's scale by w):
# subtracted again here, as transformers' GGUF reader does
NORM_SHIFT = {"gemma": 1.0, "gemma2": 1.0, "gemma3": 1.0}


def _attach_rest(hf: Any, tensors: GgufTensors, names: dict[str, str]) -> None:
    """The embedding on the file's blocks; norms and other small tensors read as float32;
    buffers computed at init (rotary frequencies) computed again off the meta device."""
    embed = hf.get_input_embeddings()
    embed_name = names.get(next(n for n, m in hf.named_modules() if m is embed) + ".weight")
    # Gemma's embeddings scale their rows by sqrt(hidden) (its ScaledWordEmbedding)
    hf.set_input_embeddings(GgufEmbedding(tensors, embed_name or "token_embd.weight",
                                          getattr(embed, "scalar_embed_scale", None)))
    shift = NORM_SHIFT.get(tensors.architecture, 0.0)
    for name, param in list(hf.named_parameters()):
        if name not in names:
            raise SpecdeckError(f"{tensors.path.name} has no tensor for {name}")
        value = _stored_value(tensors, names[name], name, hf.config).reshape(param.shape)
        if shift and name.endswith("norm.weight"):
            value = value - shift
        _set(hf, name, torch.nn.Parameter(value, requires_grad=False))
    for module_name, module in list(hf.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            _rebuild(hf, module_name, module)


def _rebuild(hf: Any, name: str, module: torch.nn.Module) -> None:
    """A module whose buffers are computed from the config (the rotary embedding)."""
    try:
        fresh = type(module)(config=hf.config)
    except TypeError as error:
        raise SpecdeckError(f"cannot rebuild {name} ({type(module).__name__}) of a GGUF model: "
                            f"{error}") from error
    parent, _, leaf = name.rpartition(".")
    setattr(hf.get_submodule(parent) if parent else hf, leaf, fresh)


def _stored_value(tensors: GgufTensors, gguf_name: str, name: str, config: Any) -> torch.Tensor:
    """A small tensor as float32, flat, with what the converter did to its values undone."""
    value = _float(tensors, gguf_name)
    if tensors.architecture in qwen35_layout.ARCHITECTURES:
        return qwen35_layout.undo(name, value, config)
    return value


def _float(tensors: GgufTensors, name: str) -> torch.Tensor:
    info = tensors.infos[name]
    values = dequantize(tensors.bytes_of(name), GGMLQuantizationType(info.ggml_type))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1))


def _set(hf: Any, name: str, value: torch.nn.Parameter) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(hf.get_submodule(parent), leaf, value)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
