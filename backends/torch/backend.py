"""PyTorch + transformers adapter: load a model, choose its sessions' cache strategy, build
the torch drafters.

Knows: transformers' AutoModelForCausalLM (a .gguf loads through the safetensors folder
backends/gguf.py keeps next to it), devices and dtypes, quantizing at load, which session
(session.py) a model's forwards run in. Must not know: drafting or verification rules (app/),
the catalogue of pairs, how a session splits, pads or captures a forward.
"""

from __future__ import annotations

import functools
import inspect
import resource
import shutil
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from app.core.protocols import (
    Capabilities,
    DrafterRequest,
    ForwardCall,
    TargetOutput,
    collect_eos_ids,
)
from app.core.types import SpecdeckError
from app.drafters.kinds import require_built
from backends.builder_table import build
from backends.cpu import cpu_has_native_bf16
from backends.dtype_rule import Probes, Source, auto_dtype
from backends.gguf import CONVERTED_SUFFIX, metadata_folder, read_error
from backends.gguf_header import architecture, file_type
from backends.torch import BUILDERS, RUNS, gguf_model, w4a8
from backends.torch import attention as torch_attention
from backends.torch.decoder import LeanDecoder, lean_reason
from backends.torch.exactness import exact_row_block, linear_layers
from backends.torch.fuse import fuse_projections
from backends.torch.gguf_model import load_gguf_model, stored_bytes
from backends.torch.layer_choice import quantize_linears
from backends.torch.output_heads import light_head
from backends.torch.quantized_linear import (
    Int4Linear,
    W8A8Linear,
    int4_is_available,
    int4_is_exact,
    w8a8_is_exact,
)
from backends.torch.session import (
    MAX_VERIFY_ROWS,
    HfSession,
    LeanSession,
    TorchSession,
    batchable,
    forward_together,
)

# int8: weight-only int8 (per output channel) with bf16 activations; w8a8: int8 activations
# too (per token), on oneDNN's kernels (CPU only); int4: 4-bit weights in groups of 32 with
# bf16 activations (CPU only); w4a8: the same 4-bit weights times int8 activations per group
# of 32 (llama.cpp's Q4_K x Q8_K arithmetic, backends/torch/w4a8.py). The 4-bit modes keep
# the output layer in 8 bits. Their other tensors are bf16.
# gguf: a .gguf's own blocks (Q4_K, Q6_K, Q8_0 ...) on ggml's kernels, float32 between them
# (backends/torch/ggml.py): the model the file defines, memory-mapped, nothing converted.
QUANTIZED = ("int8", "w8a8", "int4", "w4a8")
CPU_ONLY = ("w8a8", "int4", "w4a8", "gguf")
FOUR_BIT = ("int4", "w4a8")
_DTYPES = {"int8": torch.bfloat16, "w8a8": torch.bfloat16, "int4": torch.bfloat16,
           "w4a8": torch.bfloat16, "gguf": torch.float32,
           "float32": torch.float32,
           "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
# oneDNN's bf16 matmul takes another path for a single row (2-9 rows gave the same bits per
# row): padding every forward to 2 rows, with attention made row-invariant by
# backends/torch/attention.py, makes plain and speculative decoding share numerics.
BATCH_INVARIANT_ROWS = 2
# layer types that keep nothing between tokens (NemotronH's MLP and MoE blocks)
STATELESS = ("mlp", "moe")
# whether auto may pick int4 for a 4-bit source (dtype_rule.FOUR_BIT_MAX_BITS): measured in
# one bench run against llama.cpp plain as the common yardstick (Qwen2.5-Coder-1.5B Q4_K_M,
# HumanEval, 96 tokens, 2-core Xeon): plain end to end 0.89x llama.cpp's in int4 (its prompt
# on the 8-bit copy), 0.76x in w8a8; a 1-token forward 97 ms against 133 ms
AUTO_INT4 = True


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecdeckError("--device cuda was asked for but no CUDA GPU is visible: "
                            "use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise SpecdeckError(f"unknown device {device!r}: use auto, cpu or cuda")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    # an unquantized source: a forward over 8 bf16 tokens cost 1.13x one token (fp32: 2x),
    # and padded forwards keep it exact
    if dtype == "auto":
        return _DTYPES[auto_dtype(Source(), measured_probes(), device)[0]]
    if dtype not in _DTYPES:
        raise SpecdeckError(f"unknown dtype {dtype!r}: use auto, gguf, float32, bfloat16, "
                            "float16, int8, w8a8, int4 or w4a8")
    if dtype in CPU_ONLY and device != "cpu":
        raise SpecdeckError(f"--dtype {dtype} runs on the CPU only: use --device cpu, or "
                            "bfloat16 on a GPU")
    if dtype == "int4" and not int4_is_available():
        raise SpecdeckError(f"this PyTorch ({torch.__version__}) has no int4 CPU matmul: use "
                            "--dtype w8a8, or PyTorch 2.6 or newer")
    if dtype == "w4a8" and not w4a8.is_available():
        why = w4a8.unavailable_reason() or "its kernel did not build"
        raise SpecdeckError(f"--dtype w4a8 cannot run here: {why}; use --dtype int4")
    if dtype == "gguf" and gguf_model.unavailable_reason() is not None:
        raise SpecdeckError(f"--dtype gguf cannot run here: {gguf_model.unavailable_reason()}")
    if dtype == "w8a8" and not w8a8_is_exact():
        raise SpecdeckError("this CPU's int8 matmul saturates (no VNNI), so w8a8 would not be "
                            "lossless: use --dtype int8 (weight-only) instead")
    return _DTYPES[dtype]


def cache_kwarg(hf: Any) -> str:
    """The name the model's forward takes its cache by: transformers 5.x renamed
    past_key_values to cache (the old name warns until it is dropped)."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def auto_cpu_dtype(path: Path) -> tuple[str, str]:
    """(dtype, why) for --dtype auto on the CPU: the one rule (backends/dtype_rule.py) asked
    with this CPU's measured exactness (see docs/PERFORMANCE.md, CPU dtypes and kernels)."""
    gguf = path.suffix == ".gguf"
    name, bits = (file_type(path) if gguf else None) or (None, None)
    probes = measured_probes()
    if gguf and gguf_model.blocks_reason(architecture(path)) is not None:
        probes = replace(probes, gguf=lambda: False)  # its blocks would compute wrong values
    return auto_dtype(Source(gguf, name, bits), probes)


def measured_probes() -> Probes:
    """The rule's probes answered by this backend's own load checks, looked up when asked."""
    return Probes(gguf=lambda: gguf_model.unavailable_reason() is None,
                  w4a8=lambda: w4a8.is_exact(),
                  int4=lambda: AUTO_INT4 and int4_is_available() and int4_is_exact(),
                  w8a8=lambda: w8a8_is_exact(),
                  native_bf16=lambda: cpu_has_native_bf16())


class TorchModel:
    """A loaded transformers causal LM and its tokenizer."""

    def __init__(self, hf: Any, tokenizer: Any, name: str, device: str) -> None:
        self.hf = hf.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.device = device
        self.dtype = str(hf.dtype).removeprefix("torch.")
        self.dtype_reason = ""  # why load chose this dtype (shown by --json and the UI)
        config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
        head = hf.get_output_embeddings()
        self.vocab_size = int(head.out_features)
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 4096)
        self.eos_token_ids = _eos_ids(hf, tokenizer)
        self.layers = hf.model.layers
        self.cache_kwarg = cache_kwarg(hf)
        self.n_layers = len(self.layers)
        self.capabilities = _capabilities(config)
        # fp32 keeps exactness without padding (its multi-row forwards cost up to 2x more here)
        low_precision = hf.dtype in (torch.bfloat16, torch.float16)
        self.min_rows = BATCH_INVARIANT_ROWS if device == "cpu" and low_precision else 1
        self.row_block = MAX_VERIFY_ROWS  # verify rows per forward; set by check_exactness
        self.source: Path | None = None  # the folder it was loaded from, when it was
        # CPU sessions run the lean forward where it computes this model (decoder.py)
        self.lean = LeanDecoder(hf) if device == "cpu" and lean_reason(hf) is None else None

    def kv_bytes_per_token(self) -> int:
        """Keys and values one token takes in a session's cache, every layer."""
        config = self.hf.config.get_text_config() if hasattr(self.hf.config, "get_text_config") \
            else self.hf.config
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        dim = int(getattr(config, "head_dim", None)
                  or config.hidden_size // config.num_attention_heads)
        size = torch.finfo(self.hf.dtype).bits // 8 if self.hf.dtype.is_floating_point else 4
        return 2 * self.n_layers * heads * dim * size

    def forward_batch(self, calls: Sequence[ForwardCall]) -> list[TargetOutput]:
        """Several sessions' forwards as one where the lean forward runs them all (its
        matmuls over every call's rows); elsewhere each alone, in order."""
        if len(calls) > 1 and batchable(calls):
            return forward_together(calls)
        return [call.run() for call in calls]

    def check_exactness(self) -> None:
        """On CPU, find the verify block size that keeps each row's bits (exactness.py).

        float32 is left whole: its one-row kernel (gemv) rounds unlike any multi-row one, so
        no block size would help short of padding every decode step to 2 rows (up to 2x the
        cost); its logits differ from plain decoding's in the last bits only, and the oracle
        tests hold it to the same tokens."""
        if self.device != "cpu" or self.hf.dtype == torch.float32:
            return  # GPUs make no bitwise promise across row counts
        checked = linear_layers(self.layers[0])
        head = self.hf.get_output_embeddings()
        if isinstance(head, torch.nn.Linear):
            # the head's kernel over its first rows: the whole head would cost seconds per load
            checked.append(torch.nn.Linear(head.in_features, min(head.out_features, 4096),
                                           bias=False, dtype=head.weight.dtype))
            with torch.no_grad():
                checked[-1].weight.copy_(head.weight[:checked[-1].out_features])
        self.row_block = exact_row_block(checked, self.min_rows, self.hf.dtype)

    def start(self, capture_layers: Sequence[int] = (), exact: bool = True) -> TorchSession:
        """A new session; exact=False (drafters) skips the padding that fixes numerics."""
        bad = [i for i in capture_layers if not 0 <= i < self.n_layers]
        if bad:
            raise SpecdeckError(f"{self.name} has {self.n_layers} layers; cannot capture {bad}")
        if self.lean is not None:
            return LeanSession(self, capture_layers, exact)
        return HfSession(self, capture_layers, exact)

    @functools.cached_property
    def drafting_head(self) -> torch.nn.Module | None:
        """The 4-bit output layer drafter sessions over this model may compute with (w4a8
        models; None for others), built on first use and shared by them; the model keeps its
        own."""
        return light_head(self.hf.get_output_embeddings(), self.dtype)

    def weights_bytes(self) -> int:
        tensors = [*self.hf.parameters(), *self.hf.buffers()]  # int8 weights are buffers
        packed = sum(m.packed_bytes() for m in self.hf.modules()
                     if isinstance(m, (W8A8Linear, Int4Linear, w4a8.W4A8Linear)))
        # a drafting head, once built (cached_property keeps it in the instance's dict), holds
        # its packed codes beside the model's layer; its bias is the layer's
        light = vars(self).get("drafting_head")
        packed += light.packed_bytes() if light is not None else 0
        packed += stored_bytes(self.hf)  # a .gguf's blocks, read in place
        return packed + sum(t.numel() * t.element_size() for t in tensors)

    def peak_memory_bytes(self) -> int:
        if self.device.startswith("cuda"):
            return int(torch.cuda.max_memory_allocated())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class TorchBackend:
    """Loads HF folders and GGUF files; builds every drafter kind that needs a model."""

    name = "torch"
    runs = RUNS

    def load(self, path: str, device: str = "auto", dtype: str = "auto") -> TorchModel:
        device = resolve_device(device)
        why = f"--dtype {dtype}"
        if dtype == "auto" and device == "cpu":
            dtype, why = auto_cpu_dtype(Path(path))
        torch_dtype = resolve_dtype(dtype, device)
        hf_logging.disable_progress_bar()  # a folder loads in seconds; keep stderr clean
        # on CPU, row-invariant attention keeps plain and speculative numerics equal (and
        # gives each tree row exactly the keys its chain twin sees)
        attention = torch_attention.register() if device == "cpu" else None
        hf, tokenizer, folder = _load_hf(Path(path), dtype, torch_dtype, attention)
        if dtype != "gguf":
            fuse_projections(hf)  # before quantizing: the fused layers are quantized as one
        if dtype in QUANTIZED:
            quantize_linears(hf, dtype)
        model = TorchModel(hf.to(device), tokenizer, name=_display_name(Path(path)), device=device)
        model.source = folder  # MTP layers are read from the checkpoint's own files
        if dtype in (*QUANTIZED, "gguf"):
            model.dtype = dtype
            model.min_rows = 1  # their matmuls give a row the same bits for any row count
        model.dtype_reason = why
        model.check_exactness()
        return model

    def make_drafter(self, kind: str, target: TorchModel, *, draft: TorchModel | None = None,
                     head: str | None = None, tree: bool = False, vocab_limit: int = 0) -> Any:
        """The drafter of a kind this backend builds (BUILDERS), checked against the target."""
        require_built(kind, self.runs, capabilities=target.capabilities, tree=tree,
                      has_draft=draft is not None, has_head=bool(head), target=target.name)
        request = DrafterRequest(kind, target, draft, head, tree, vocab_limit)
        return build(BUILDERS, "backends.torch.builders", request)


def _load_hf(path: Path, dtype: str, torch_dtype: torch.dtype,
             attention: str | None) -> tuple[Any, Any, Path]:
    """(model, tokenizer, folder of its config): a folder through transformers; a .gguf on
    its own blocks (dtype gguf), else dequantized in memory by transformers (never on disk)."""
    if not path.exists():
        raise SpecdeckError(f"model not found: {path}. Give an HF model folder or a .gguf file, "
                            "or download a pair with `specdeck pull`")
    if dtype == "gguf" and path.suffix != ".gguf":
        raise SpecdeckError(f"--dtype gguf computes on a .gguf file's blocks; {path} is not "
                            "one: use --dtype auto")
    extra = {"attn_implementation": attention} if attention else {}
    try:
        if path.suffix == ".gguf":
            _report_stale_conversion(path)
            if dtype == "gguf":
                return (*load_gguf_model(path, attention), metadata_folder(path))
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      dtype=torch_dtype, **extra)
            return hf, AutoTokenizer.from_pretrained(str(metadata_folder(path))), path.parent
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, **extra)
        return hf, AutoTokenizer.from_pretrained(str(path)), path
    except (OSError, ValueError) as error:
        if path.suffix == ".gguf":
            raise read_error(path, error) from error
        raise SpecdeckError(f"could not load a model from {path}: {error}. Check that the "
                            "folder holds config.json, weights and tokenizer files, or "
                            "re-download it with `specdeck pull`") from error


def _report_stale_conversion(gguf: Path) -> None:
    """Earlier versions kept a dequantized float32 copy beside each .gguf (several times its
    size); nothing reads it now, so the upgrade frees that disk."""
    stale = gguf.with_name(gguf.name + CONVERTED_SUFFIX)
    if not stale.is_dir():
        return
    size = sum(f.stat().st_size for f in stale.rglob("*") if f.is_file())
    shutil.rmtree(stale, ignore_errors=True)
    print(f"specdeck: removed {stale.name} ({size / 2**30:.1f} GiB), the dequantized copy "
          "earlier versions kept; the model now runs on the .gguf itself", file=sys.stderr)


def _eos_ids(hf: Any, tokenizer: Any) -> frozenset[int]:
    """Every end-of-sequence id the model declares (Qwen declares several)."""
    return collect_eos_ids(getattr(hf.generation_config, "eos_token_id", None),
                           getattr(hf.config, "eos_token_id", None), tokenizer.eos_token_id)


def _capabilities(config: Any) -> Capabilities:
    """Every target rewinds (a window or a recurrent state through its recorded past,
    rewind.py); one that keeps a state or a window per token verifies chains only."""
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    recurrent = layer_types - {"full_attention", "sliding_attention", *STATELESS}
    windowed = "sliding_attention" in layer_types or (
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))
    if recurrent:
        return Capabilities(rewind=True, hidden_states=True, tree_attention=False,
                            reason=f"layers of type {sorted(recurrent)} keep one recurrent "
                                   "state per token, rewound along a chain (no tree)")
    if windowed:
        return Capabilities(rewind=True, hidden_states=True, tree_attention=False,
                            reason="its sliding-window layers keep the last keys of one "
                                   "chain, rewound along it (no tree)")
    return RUNS.capabilities  # 4D masks: trees


def _display_name(path: Path) -> str:
    return path.name.removesuffix(".gguf") or str(path)
