"""Choose the drafter for a target, and size what fits in memory (servable context, streams).

Knows: the preference order (`PREFERENCE`, one `Rank` a kind: the target's own MTP layers,
then a drafter shipped for it: DSpark, DFlash, EAGLE-3, EAGLE, Medusa; then a same-family
draft model, then the drafters that need no model: lookup or lookahead by device), weights,
KV-cache and verify-state arithmetic, how to read a model's numbers from the catalogue, a
config.json or a GGUF header, and how much memory is free (psutil for RAM, nvidia-smi for
CUDA, about 75% of RAM for MLX's Metal working set). Must not know: downloads, array libraries
(app/ never imports torch), whether a kind runs on a backend (app/drafters/kinds.py's check
says, as it does for every surface).

API:
    available_memory(backend, device="auto") -> bytes free for models now
    describe(target, catalogue=None) -> TargetInfo   a pair id, catalogue model or hub repo id,
                                                     or a local HF folder or .gguf file
    kv_bytes_per_token(arch, dtype_bytes) -> layers x kv heads x head dim x 2 (K and V) x size
    fit(target, drafter, memory, context) -> Fit     with and without speculation;
                                                     Fit.rows() labels the drafter's memory
    verify_state(kind, k, target_arch, drafter_arch, dtype) -> (rows, bytes) per verify step
    pair_fit(pair, backend, device, memory, context) -> Fit
    plan(target, backend, device, memory, context, catalogue, implemented, installed, runs)
        -> Plan
        Plan.choice (an Option: kind, model, reason), Plan.refused (each with its reason),
        Plan.passed (usable, but ranked after the choice), Plan.absent (kinds of the order
        with no candidate for this target, and why), Plan.reasons() as lines for a terminal
        or the UI.
Memory figures leave RESERVE of the memory free for activations and verify buffers, and count
the runtime itself (RUNTIME_BYTES). On a CPU torch runs a GGUF on the file's own blocks (its
bytes, a float32 KV cache); other sources in the dtype `dtype_for` names. MLX keeps a 4-bit
checkpoint 4-bit and its KV cache in fp16.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.catalogue.registry import (
    FORMAT_BITS,
    IMPLEMENTED_KINDS,
    Arch,
    Catalogue,
    ModelSpec,
    PairSpec,
    load_catalogue,
)
from app.core.protocols import Runs
from app.core.types import SpecdeckError
from app.drafters.kinds import chains_only, check
from app.drafters.native import mtp_layers

RESERVE = 0.10  # share of free memory kept for activations, verify buffers and the runtime
MLX_WORKING_SET = 0.75  # Metal lets a process wire about this share of RAM by default
MAX_DRAFT_RATIO = 1 / 3  # a draft model larger than this share of the target rarely pays off
# a head whose training recorded a held-out τ (tokens per step: 1 + its chained accuracy)
# below this is passed over: a head trained in 20 s on 24 prompts recorded τ 1.008, was chosen
# over prompt lookup, and its first reply ran at 0.70x plain with acceptance 0
MIN_HEAD_TAU = 1.2
HEAD_RECORD = "specdeck.json"  # what train-head writes beside a head's weights
# where a drafter comes from: the target's own weights, a model trained for the target (a
# head or block drafter the catalogue ships), a smaller model of its family, or nothing
OWN, SHIPPED, DRAFT, FREE = "own layers", "shipped", "draft model", "no model"
PER_DRAFTER_LAYER = 0  # captures: one target layer per drafter layer (DFlash, DSpark)


@dataclass(frozen=True)
class Rank:
    """One place in the order: a kind, where it comes from, and why it stands there.

    captures: the target layers whose hidden states each verify row hands the drafter (the
    verify state); kv_cache: whether the drafter keeps a KV cache of its own per token."""

    kind: str
    source: str
    why: str
    captures: int = 0
    kv_cache: bool = True


# the order drafters are tried in, best first; a new kind is one line here
PREFERENCE = (
    Rank("mtp", OWN, "trained with the target and inside its weights: nothing to download",
         captures=1),
    Rank("dspark", SHIPPED, "a block drafter shipped for the target: one forward drafts a "
         "block, and its confidence head says where to cut it", captures=PER_DRAFTER_LAYER),
    Rank("dflash", SHIPPED, "a block drafter shipped for the target: one forward drafts a "
         "whole block", captures=PER_DRAFTER_LAYER),
    Rank("eagle3", SHIPPED, "a head shipped for the target, reading three of its layers",
         captures=3),
    Rank("eagle", SHIPPED, "a head shipped for the target, reading its last layer", captures=1),
    Rank("medusa", SHIPPED, "heads shipped for the target; each guesses one position on its "
         "own", captures=1, kv_cache=False),
    Rank("draft", DRAFT, "a separate small model: its own weights and KV cache, no training "
         "for the target"),
    Rank("lookahead", FREE, "its tree costs many verify rows per step", kv_cache=False),
    Rank("ngram", FREE, "needs no model; drafts only text that repeats", kv_cache=False),
)
RANKS = {rank.kind: rank for rank in PREFERENCE}
HEAD_KINDS = tuple(r.kind for r in PREFERENCE if r.source == SHIPPED)  # shipped for one target
MODEL_FREE = frozenset(r.kind for r in PREFERENCE if r.source == FREE)
LOGIT_BYTES = 4  # the verify keeps each row's logits in float32 for the sampler
# bytes per weight; int4 and w4a8: 4-bit codes and a bf16 scale and zero per 32
# (backends/torch/quant.py Int4Linear, backends/torch/w4a8.py); gguf: the file's own bytes
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "w8a8": 1, "int4": 0.625,
                "w4a8": 0.625}
QUANTIZED = ("w8a8", "int4", "w4a8")  # quantized weights, bf16 KV cache
GGUF_KV_BYTES = 4  # a GGUF computes in float32 between its matmuls, its KV cache included
# resident memory of a process before any weights: Python, the array library, transformers and
# the server (after importing app.serve.server here: 383 MiB with torch, 268 MiB with MLX's
# Linux CPU build)
RUNTIME_BYTES = {"torch": 400 * 2**20, "mlx": 270 * 2**20}
W8A8_MAX_BITS = 8.5  # --dtype auto runs a source this coarse as w8a8 (backends/torch)
INT4_MAX_BITS = 5.0  # and a source this coarse as int4, where torch has the kernel
INT4_TORCH = (2, 6)  # the first torch with _weight_int4pack_mm_for_cpu


@dataclass(frozen=True)
class Sizing:
    """What one model costs in memory on one backend."""

    weights_bytes: int
    kv_bytes_per_token: int
    context_limit: int  # the context the model was trained for


@dataclass(frozen=True)
class Fit:
    backend: str
    device: str
    dtype: str
    available_bytes: int
    usable_bytes: int  # available minus RESERVE
    target_weights_bytes: int
    drafter_weights_bytes: int
    target_kv_per_token: int
    drafter_kv_per_token: int
    context_limit: int
    max_context_plain: int  # longest context one stream can hold without a drafter
    max_context_spec: int  # ... with the drafter's weights and its own KV cache
    context: int  # the per-stream context the stream counts use
    streams_plain: int
    streams_spec: int
    runtime_bytes: int = 0  # the process before any weights (RUNTIME_BYTES)
    # what one verify step holds for the drafter: k + 1 rows of float32 logits and the
    # captured hidden states (within RESERVE, so not in memory_bytes)
    verify_rows: int = 0
    verify_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        """What serving one stream of `context` tokens with speculation takes: the runtime,
        both models' weights and both KV caches."""
        return (self.runtime_bytes + self.target_weights_bytes + self.drafter_weights_bytes
                + self.context * (self.target_kv_per_token + self.drafter_kv_per_token))

    @property
    def fits(self) -> bool:
        return self.streams_spec >= 1

    @property
    def target_fits(self) -> bool:
        return self.streams_plain >= 1

    def summary(self) -> str:
        if not self.target_fits:
            need = self.target_weights_bytes + self.context * self.target_kv_per_token
            return f"target does not fit: needs {_gb(need)}, {_gb(self.usable_bytes)} usable"
        return (f"{self.max_context_plain}/{self.max_context_spec}, "
                f"{self.streams_plain}/{self.streams_spec}")

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "fits": self.fits, "memory_bytes": self.memory_bytes}

    def rows(self) -> list[tuple[str, str]]:
        """The drafter's memory as labelled rows (models --why and the UI's pair card): its
        weights, the verify state, KV per token of each model, servable context."""
        verify = (f"{_size(self.verify_bytes)} ({self.verify_rows} rows)" if self.verify_rows
                  else "-")
        return [("target weights", _size(self.target_weights_bytes)),
                ("drafter weights", _size(self.drafter_weights_bytes)),
                ("verify state", verify),
                ("KV per token", f"{_kib(self.target_kv_per_token)} target + "
                                 f"{_kib(self.drafter_kv_per_token)} drafter"),
                ("servable context", f"{self.max_context_plain} plain / "
                                     f"{self.max_context_spec} with the drafter")]


@dataclass(frozen=True)
class TargetInfo:
    label: str  # what was asked for
    model: ModelSpec | None  # the catalogue entry, when the target is in the catalogue
    family: str | None
    params: int
    arch: Arch
    path: Path | None = None  # local file or folder, when given one


@dataclass(frozen=True)
class Option:
    """A drafter considered for a target: chosen or refused, with the reason."""

    kind: str
    reason: str
    model: ModelSpec | None = None
    pair_id: str | None = None
    path: Path | None = None  # where the drafter model is installed, when it is
    k: int = 4

    @property
    def label(self) -> str:
        return f"{self.kind} {self.model.id}" if self.model else self.kind


@dataclass(frozen=True)
class Plan:
    target: TargetInfo
    choice: Option
    fit: Fit
    refused: tuple[Option, ...] = field(default=())
    passed: tuple[Option, ...] = field(default=())  # usable, ranked after the choice
    absent: tuple[Option, ...] = field(default=())  # kinds in the order with no candidate here

    def reasons(self) -> list[str]:
        lines = [f"drafter: {self.choice.label} ({self.choice.reason})"]
        lines += [f"not {o.label}: {o.reason}" for o in self.refused]
        lines += [f"not {o.label}: ranked after {self.choice.kind} ({o.reason})"
                  for o in self.passed]
        if self.absent:
            lines.append(_absent_line(self.absent))
        if not self.fit.target_fits:
            lines.append(f"warning: {self.fit.summary()}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        def option(o: Option) -> dict[str, Any]:
            return {"kind": o.kind, "model": o.model.id if o.model else None,
                    "pair": o.pair_id, "reason": o.reason, "k": o.k,
                    "path": str(o.path) if o.path else None}
        return {"target": self.target.label, "choice": option(self.choice),
                "refused": [option(o) for o in self.refused],
                "passed": [option(o) for o in self.passed],
                "absent": [option(o) for o in self.absent], "fit": self.fit.to_dict()}


def _absent_line(absent: tuple[Option, ...]) -> str:
    """One line for the kinds that had no candidate, grouped by why: "none here: mtp (the
    target carries no MTP layers); eagle, medusa (the catalogue ships none for this target)"."""
    groups: dict[str, list[str]] = {}
    for option in absent:
        groups.setdefault(option.reason, []).append(option.kind)
    return "none here: " + "; ".join(f"{', '.join(kinds)} ({reason})"
                                      for reason, kinds in groups.items())


# ---- memory ----------------------------------------------------------------------------


def resolve_device(backend: str, device: str = "auto") -> str:
    if backend == "mlx":
        return "gpu"
    if device == "auto":
        return "cuda" if cuda_free_bytes() is not None else "cpu"
    return device


def dtype_for(backend: str, device: str, fmt: str | None = None,
              bits: float | None = None, gguf: bool | None = None) -> str:
    """The dtype `--dtype auto` loads weights in: MLX float16; on a CPU a GGUF (gguf: the
    source is one; by default read from fmt) on its own blocks where a kernel for them runs;
    else, for a source of 5 bits per weight or fewer (a Q4 GGUF), w4a8 with AVX512-VNNI, else
    int4 where torch has its int4 kernel; w8a8 with VNNI for 8.5 bits or fewer, else bfloat16
    on CUDA and on CPUs with native bf16, else float32 (backends/torch/backend.py decides the
    same way, after its exactness checks)."""
    from backends.cpu import cpu_has_native_bf16, cpu_has_vnni, cpu_has_w4a8

    if backend == "mlx":
        return "float16"
    gguf = bool(fmt and fmt.startswith("gguf-")) if gguf is None else gguf
    if device == "cpu" and gguf and _gguf_runs_here():
        return "gguf"
    if bits is None and fmt:
        bits = _quant_bits(fmt)
    four_bit = device == "cpu" and bits is not None and bits <= INT4_MAX_BITS
    if four_bit and cpu_has_w4a8():
        return "w4a8"
    if four_bit and _torch_has_int4():
        return "int4"
    if device == "cpu" and bits is not None and bits <= W8A8_MAX_BITS and cpu_has_vnni():
        return "w8a8"
    if device.startswith("cuda") or cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


def _quant_bits(fmt: str) -> float | None:
    """The bits per weight of a catalogue format's main tensors, as the GGUF header names them
    (the backend decides from the header; FORMAT_BITS is file size, embeddings included)."""
    from backends.gguf_header import FILE_TYPES

    if fmt.startswith("gguf-"):
        name = fmt.removeprefix("gguf-").upper()
        return next((bits for n, bits in FILE_TYPES.values() if n == name), FORMAT_BITS.get(fmt))
    return FORMAT_BITS.get(fmt)


def _gguf_runs_here() -> bool:
    """Whether torch runs a GGUF on its own blocks here (backends/torch/gguf_model.py), judged
    without importing torch: kquant needs AVX512-VNNI, ggml llama-cpp-python; both a compiler."""
    import importlib.util

    from backends.cpu import cpu_has_w4a8
    from backends.torch.cbuild import compiler

    kernel = cpu_has_w4a8() or importlib.util.find_spec("llama_cpp") is not None
    return kernel and compiler() is not None


def _torch_has_int4() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = re.match(r"(\d+)\.(\d+)", version("torch"))
    except PackageNotFoundError:
        return False
    return release is not None and (int(release[1]), int(release[2])) >= INT4_TORCH


def _kv_bytes(dtype: str) -> int:
    # quantized modes quantize weights only: their KV cache is bf16
    if dtype == "gguf":
        return GGUF_KV_BYTES
    return 2 if dtype in QUANTIZED else _DTYPE_BYTES[dtype]


def available_memory(backend: str, device: str = "auto") -> int:
    import psutil

    device = resolve_device(backend, device)
    ram = psutil.virtual_memory()
    if backend == "mlx":
        return int(min(ram.available, ram.total * MLX_WORKING_SET))
    if device.startswith("cuda"):
        free = cuda_free_bytes()
        if free is not None:
            return free
    return int(ram.available)


def cuda_free_bytes() -> int | None:
    """Free memory of the first CUDA GPU via nvidia-smi (no torch import), or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def parse_bytes(text: str) -> int:
    """'16GB', '12 GiB', '800MB' or a plain number of bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?i?b?)\s*", text.lower())
    if not match:
        raise SpecdeckError(f"cannot read {text!r} as a size: write e.g. 16GB or 800MB")
    unit = match[2].rstrip("b")
    base = 1024 if unit.endswith("i") else 1000
    power = "kmgt".find(unit[:1]) + 1 if unit else 0
    return int(float(match[1]) * base**power)


def kv_bytes_per_token(arch: Arch, dtype_bytes: int, layers: int | None = None) -> int:
    """K and V for one token across the layers: layers x kv heads x head dim x 2 x size."""
    return (arch.layers if layers is None else layers) * arch.kv_heads * arch.head_dim * 2 \
        * dtype_bytes


def weights_bytes(params: int, backend: str, dtype: str, fmt: str | None,
                  file_bytes: int | None = None) -> int:
    """A GGUF on its own blocks and MLX's quantized checkpoints take their bytes on disk
    (file_bytes where known, else estimated from params); torch converts others to dtype."""
    if dtype == "gguf" or (backend == "mlx" and fmt is not None):
        return file_bytes or int(params * FORMAT_BITS.get(fmt or "", 16) / 8)
    return int(params * _DTYPE_BYTES[dtype])


def fit(target: Sizing, drafter: Sizing | None, memory: int, context: int,
        backend: str = "", device: str = "", dtype: str = "",
        verify: tuple[int, int] = (0, 0)) -> Fit:
    """Servable context and concurrent streams of `context` tokens, plain and speculative;
    verify: (rows, bytes) of the verify state (`verify_state`)."""
    drafter = drafter or Sizing(0, 0, target.context_limit)
    runtime = RUNTIME_BYTES.get(backend, 0)
    usable = int(memory * (1 - RESERVE)) - runtime
    room_plain = usable - target.weights_bytes
    room_spec = room_plain - drafter.weights_bytes
    kv_spec = target.kv_bytes_per_token + drafter.kv_bytes_per_token
    limit = min(target.context_limit, drafter.context_limit)

    def longest(room: int, per_token: int, cap: int) -> int:
        return max(0, min(cap, room // per_token)) if room > 0 else 0

    def streams(room: int, per_token: int) -> int:
        return max(0, room // (per_token * context)) if room > 0 else 0

    return Fit(backend=backend, device=device, dtype=dtype, available_bytes=memory,
               usable_bytes=usable, runtime_bytes=runtime,
               target_weights_bytes=target.weights_bytes,
               drafter_weights_bytes=drafter.weights_bytes,
               target_kv_per_token=target.kv_bytes_per_token,
               drafter_kv_per_token=drafter.kv_bytes_per_token, context_limit=limit,
               max_context_plain=longest(room_plain, target.kv_bytes_per_token,
                                         target.context_limit),
               max_context_spec=longest(room_spec, kv_spec, limit), context=context,
               streams_plain=streams(room_plain, target.kv_bytes_per_token),
               streams_spec=streams(room_spec, kv_spec), verify_rows=verify[0],
               verify_bytes=verify[1])


def verify_state(kind: str, k: int, target_arch: Arch, drafter_arch: Arch | None,
                 dtype: str) -> tuple[int, int]:
    """(rows, bytes) one verify step holds for a drafter of kind drafting k tokens: each of
    the k + 1 rows keeps float32 logits over the target's vocabulary and the hidden states of
    the target layers the drafter reads (a chain's rows; a tree verifies its nodes)."""
    rank = RANKS.get(kind)
    if rank is None or kind == "none":
        return 0, 0
    layers = rank.captures
    if layers == PER_DRAFTER_LAYER and rank.source == SHIPPED and drafter_arch is not None:
        layers = drafter_arch.layers
    rows = k + 1
    per_row = target_arch.vocab * LOGIT_BYTES + layers * target_arch.hidden * _kv_bytes(dtype)
    return rows, rows * per_row


def source_format(model: ModelSpec, backend: str) -> str | None:
    sources = model.sources_for(backend)
    return sources[0].format if sources else None


def _target_source(info: TargetInfo, backend: str) -> tuple[str | None, float | None]:
    """(format, bits per weight) of the target's source: the catalogue's, or a local GGUF's
    header (`--dtype auto` reads the same header)."""
    from backends.gguf_header import file_type

    if info.model is not None:
        return source_format(info.model, backend), None
    if info.path is not None and info.path.suffix == ".gguf":
        kind = file_type(info.path)
        return None, kind[1] if kind else None
    return None, None


def model_sizing(model: ModelSpec, backend: str, dtype: str, draft: bool = False) -> Sizing:
    """A catalogue model's weights (a GGUF: its listed file bytes) and KV cache; a draft
    model in a 4-bit-capable mode adds the 4-bit copy of its output layer it drafts through
    (backends/torch/output_heads.py)."""
    fmt = source_format(model, backend)
    weights = weights_bytes(model.params, backend, dtype, fmt, model.download_bytes(backend)[0])
    if draft and dtype in ("gguf", "w4a8"):
        weights += int(model.arch.vocab * model.arch.hidden * _DTYPE_BYTES["w4a8"])
    return Sizing(weights, kv_bytes_per_token(model.arch, _kv_bytes(dtype)), model.arch.context)


def drafter_sizing(kind: str, model: ModelSpec | None, target_arch: Arch, backend: str,
                   dtype: str) -> Sizing | None:
    """MTP layers live in the target's weights but keep their own KV cache; Medusa's heads
    keep none (each is an MLP on the target's last hidden state)."""
    if kind == "mtp":
        return Sizing(0, kv_bytes_per_token(target_arch, _kv_bytes(dtype),
                                            target_arch.mtp_layers), target_arch.context)
    if model is None:
        return None
    sizing = model_sizing(model, backend, dtype, draft=kind == "draft")
    if kind in RANKS and not RANKS[kind].kv_cache:
        return Sizing(sizing.weights_bytes, 0, sizing.context_limit)
    return sizing


def pair_fit(pair: PairSpec, backend: str, device: str, memory: int, context: int) -> Fit:
    device = resolve_device(backend, device)
    dtype = dtype_for(backend, device, source_format(pair.target, backend))
    drafter = drafter_sizing(pair.drafter_kind, pair.drafter, pair.target.arch, backend, dtype)
    verify = verify_state(pair.drafter_kind, pair.k, pair.target.arch,
                          pair.drafter.arch if pair.drafter else None, dtype)
    return fit(model_sizing(pair.target, backend, dtype), drafter, memory, context,
               backend, device, dtype, verify)


# ---- what the target is ----------------------------------------------------------------


def describe(target: str, catalogue: Catalogue | None = None) -> TargetInfo:
    """Numbers of a target given as a pair id, catalogue model id, hub repo id or local path."""
    catalogue = catalogue or load_catalogue()
    model = _catalogue_model(target, catalogue)
    if model is not None:
        return TargetInfo(target, model, model.family, model.params, model.arch)
    path = Path(target).expanduser()
    if path.exists():
        arch, params = _local_numbers(path)
        same = _same_arch(arch, catalogue)  # its family tells which drafts share the tokenizer
        return TargetInfo(target, same, same.family if same else None, params, arch, path)
    raise SpecdeckError(f"unknown target {target!r}: give a pair id or model from `specdeck "
                        "models`, a catalogue hub id, or a local HF folder or .gguf file")


def _catalogue_model(target: str, catalogue: Catalogue) -> ModelSpec | None:
    if target in catalogue.pairs:
        return catalogue.pairs[target].target
    if target in catalogue.models:
        return catalogue.models[target]
    for model in catalogue.models.values():
        if any(getattr(s, "repo", None) == target for ss in model.sources.values() for s in ss):
            return model
    # a file the store installed: .../models/<model id>/<backend>/<file>
    parts = Path(target).parts
    for i, part in enumerate(parts[:-1]):
        if part == "models" and i + 1 < len(parts) and parts[i + 1] in catalogue.models:
            return catalogue.models[parts[i + 1]]
    return None


def _same_arch(arch: Arch, catalogue: Catalogue) -> ModelSpec | None:
    """A catalogue model with this shape: its family tells which drafts share the tokenizer."""
    for model in catalogue.models.values():
        a = model.arch
        if (a.layers, a.hidden, a.kv_heads, a.vocab) == (arch.layers, arch.hidden,
                                                          arch.kv_heads, arch.vocab):
            return model
    return None


def arch_from_config(config: dict[str, Any]) -> Arch:
    """The numbers of an HF config.json (multimodal configs keep them in text_config)."""
    c = config.get("text_config") or config
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    return Arch(layers=int(c["num_hidden_layers"]), hidden=hidden, heads=heads,
                kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or hidden // heads),
                vocab=int(c["vocab_size"]),
                context=int(c.get("max_position_embeddings") or 4096),
                mtp_layers=mtp_layers(config))


def _local_numbers(path: Path) -> tuple[Arch, int]:
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            arch = arch_from_config(config)
        except (OSError, ValueError, KeyError) as error:
            raise SpecdeckError(f"cannot read {path / 'config.json'}: {error}. Give an HF "
                                "model folder") from error
        params = sum(_safetensors_params(f) for f in path.glob("*.safetensors"))
        return arch, params or _estimate_params(arch)
    if path.suffix == ".gguf":
        return _gguf_numbers(path)
    raise SpecdeckError(f"{path} is neither an HF model folder nor a .gguf file")


def _safetensors_params(file: Path) -> int:
    """Element count from a safetensors header (8-byte length, then JSON); no tensor read."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def _estimate_params(arch: Arch) -> int:
    return 12 * arch.layers * arch.hidden**2 + arch.vocab * arch.hidden


def _gguf_numbers(path: Path) -> tuple[Arch, int]:
    try:
        from gguf import GGUFReader
    except ImportError as error:
        raise SpecdeckError("reading a .gguf needs the gguf package: pip install "
                            "'specdeck[torch]'") from error
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError, IndexError) as error:  # IndexError: a file cut short
        raise SpecdeckError(f"cannot read {path}: {error}. The file may be partial: download "
                            "it again") from error

    def value(key: str, default: Any = None) -> Any:
        fld = reader.fields.get(key)
        if fld is None:
            return default
        return fld.parts[fld.data[0]].tolist()[0] if fld.data else default

    name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    hidden = int(value(f"{name}.embedding_length"))
    heads = int(value(f"{name}.attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    arch = Arch(layers=int(value(f"{name}.block_count")), hidden=hidden, heads=heads,
                kv_heads=int(value(f"{name}.attention.head_count_kv", heads)),
                head_dim=int(value(f"{name}.attention.key_length", hidden // heads)),
                vocab=len(tokens.data) if tokens is not None else 0,
                context=int(value(f"{name}.context_length", 4096)),
                mtp_layers=int(value(f"{name}.nextn_predict_layers", 0)))
    params = sum(int(math.prod(int(d) for d in t.shape)) for t in reader.tensors)
    return arch, params


# ---- the choice ------------------------------------------------------------------------


Installed = Callable[[ModelSpec], Path | None]


def plan(target: str | TargetInfo, backend: str = "torch", device: str = "auto",
         memory: int | None = None, context: int = 4096, catalogue: Catalogue | None = None,
         implemented: frozenset[str] = IMPLEMENTED_KINDS,
         installed: Installed | None = None, runs: Runs | None = None) -> Plan:
    """The drafter for a target: the first in `preference` order that is implemented,
    runs here (kinds.check), is available and fits; every other candidate is refused or
    passed over, with its reason.

    installed: when given, the local path of a drafter model or None when it is not
    downloaded (a drafter that is not downloaded is refused, never fetched silently).
    runs: what the backend that runs the drafters runs, when it is not `backend` (llama.cpp
    plans over the GGUF files pulled for torch); else `backend`'s own.
    """
    from backends import runs_of

    catalogue = catalogue or load_catalogue()
    info = describe(target, catalogue) if isinstance(target, str) else target
    device = resolve_device(backend, device)
    local_gguf = info.path is not None and info.path.suffix == ".gguf"
    dtype = dtype_for(backend, device, *_target_source(info, backend),
                      gguf=True if local_gguf else None)  # None: read from the format
    memory = available_memory(backend, device) if memory is None else memory
    ctx = _Context(info, backend, device, dtype, memory, context, implemented, installed,
                   runs or runs_of(backend))
    refused: list[Option] = []
    usable: list[Option] = []
    candidates = _candidates(info, catalogue)
    for candidate in ordered(candidates, backend, device):
        problem = ctx.problem(candidate)
        if problem:
            refused.append(Option(candidate.kind, problem, candidate.model, candidate.pair_id,
                                  k=candidate.k))
            continue
        path = installed(candidate.model) if installed and candidate.model else None
        usable.append(Option(candidate.kind, candidate.reason, candidate.model,
                             candidate.pair_id, path, candidate.k))
    if not usable:  # only when a caller's `implemented` leaves out every model-free kind
        usable.append(Option("none", "no implemented drafter applies: plain decoding"))
    choice, *passed = usable
    return Plan(info, choice, ctx.fit(choice), tuple(refused), tuple(passed),
                _absent(info, candidates, preference(backend, device)))


def preference(backend: str, device: str) -> tuple[str, ...]:
    """Drafter kinds, best first, on this backend and device.

    The model-free pair swaps off CUDA: on a CPU or an Apple GPU a verify row costs about as
    much as a decoded token, so lookahead's wide tree loses to lookup (measured in
    docs/PERFORMANCE.md, drafters that need no model), while a GPU verifies the rows nearly
    for free.
    """
    kinds = [rank.kind for rank in PREFERENCE]
    if backend == "mlx" or not device.startswith("cuda"):
        i, j = kinds.index("lookahead"), kinds.index("ngram")
        kinds[i], kinds[j] = kinds[j], kinds[i]
    return tuple(kinds)


def ordered(options: list[Option], backend: str, device: str) -> list[Option]:
    """Options in preference order; a kind's own options keep their order (pair first)."""
    rank = {kind: i for i, kind in enumerate(preference(backend, device))}
    return sorted(options, key=lambda o: rank.get(o.kind, len(rank)))


@dataclass(frozen=True)
class _Context:
    info: TargetInfo
    backend: str
    device: str
    dtype: str
    memory: int
    context: int
    implemented: frozenset[str]
    installed: Installed | None
    runs: Runs

    def target_sizing(self) -> Sizing:
        info = self.info
        if info.path is None and info.model is not None:
            return model_sizing(info.model, self.backend, self.dtype)
        weights = weights_bytes(info.params, self.backend, self.dtype, None)
        if info.path is not None and (self.backend == "mlx" or self.dtype == "gguf"):
            weights = _disk_bytes(info.path)  # kept as it is on disk
        return Sizing(weights, kv_bytes_per_token(info.arch, _kv_bytes(self.dtype)),
                      info.arch.context)

    def fit(self, option: Option) -> Fit:
        drafter = drafter_sizing(option.kind, option.model, self.info.arch, self.backend,
                                 self.dtype)
        verify = verify_state(option.kind, option.k, self.info.arch,
                              option.model.arch if option.model else None, self.dtype)
        return fit(self.target_sizing(), drafter, self.memory, self.context, self.backend,
                   self.device, self.dtype, verify)

    def problem(self, option: Option) -> str:
        """Why this drafter cannot be used here, or '' when it can."""
        if option.kind not in self.implemented:
            return f"needs {option.kind}: specdeck does not run this drafter kind yet"
        refusal = check(option.kind, self.runs)
        if refusal is not None:
            return refusal.message
        shrinks = chains_only(option.kind, self.runs)
        if shrinks:
            return shrinks  # it runs, but pays less than it does where trees are verified
        if option.kind in MODEL_FREE:
            return ""  # no weights, no KV cache of its own: it fits wherever the target does
        if option.kind == "draft" and option.model.params > self.info.params * MAX_DRAFT_RATIO:
            share = option.model.params / self.info.params
            return f"too large to pay off: {share:.0%} of the target's parameters"
        if option.model is not None:
            sources = option.model.sources_for(self.backend)
            if not sources:
                return f"{option.model.id} has no {self.backend} source"
            if all(s.format.startswith("pytorch") for s in sources):
                return (f"{option.model.id} ships only a pickle checkpoint, which specdeck never "
                        "loads (safetensors only)")
            path = self.installed(option.model) if self.installed is not None else None
            if self.installed is not None and path is None:
                pull = f"specdeck pull {option.pair_id}" if option.pair_id else "a pull"
                return f"{option.model.id} is not downloaded (`{pull}` fetches it)"
            tau = recorded_tau(path) if option.kind in HEAD_KINDS and path else None
            if tau is not None and tau < MIN_HEAD_TAU:
                return (f"its training recorded a held-out τ of {tau:.3f} tokens per step, "
                        f"under the {MIN_HEAD_TAU} a head needs to pay for its drafting: "
                        "train it on more prompts (`specdeck train-head`)")
        result = self.fit(option)
        if not result.target_fits and option.model is not None:
            return f"the target alone does not fit ({result.summary()})"
        if not result.fits:
            extra = result.drafter_weights_bytes + self.context * result.drafter_kv_per_token
            return (f"does not fit: its weights and KV cache need {_gb(extra)} more for one "
                    f"stream of {self.context} tokens; {_gb(result.usable_bytes)} usable")
        return ""


def _candidates(info: TargetInfo, catalogue: Catalogue) -> list[Option]:
    """Every drafter worth considering for this target, each with its case (`ordered` ranks
    them)."""
    why = {rank.kind: rank.why for rank in PREFERENCE}
    found: list[Option] = []
    if info.arch.mtp_layers > 0:
        found.append(Option("mtp", f"the target carries {info.arch.mtp_layers} native MTP "
                            f"layer(s): {why['mtp']}", k=info.arch.mtp_layers))
    pairs = [p for p in catalogue.pairs.values()
             if info.model is not None and p.target.id == info.model.id]
    for p in pairs:
        if p.drafter_kind in HEAD_KINDS:
            found.append(Option(p.drafter_kind, f"trained for this target: {why[p.drafter_kind]}",
                                p.drafter, p.id, k=p.k))
    seen: set[str] = set()
    for p in pairs:
        if p.drafter_kind == "draft":
            seen.add(p.drafter.id)
            found.append(Option("draft", "the catalogue's draft model for this target",
                                p.drafter, p.id, k=p.k))
    if info.model is not None:
        for model in catalogue.draft_models_for(info.model):
            if model.id not in seen:
                found.append(_family_draft(model, info, catalogue))
    found.append(Option("lookahead", "needs no model: Jacobi iteration drafts n-grams the "
                        f"target itself proposes; {why['lookahead']}"))
    found.append(Option("ngram", "needs no model or memory: drafts repeats of the prompt and "
                        "output"))
    return found


def _absent(info: TargetInfo, candidates: list[Option],
            kinds: tuple[str, ...]) -> tuple[Option, ...]:
    """The kinds of the order with no candidate for this target, each with why."""
    offered = {o.kind for o in candidates}
    why = {OWN: "the target carries no MTP layers",
           SHIPPED: "the catalogue ships none for this target",
           DRAFT: f"the catalogue has no smaller {info.family} model" if info.family
           else "its family is unknown, so no draft model is known to share its tokenizer"}
    return tuple(Option(kind, why[RANKS[kind].source]) for kind in kinds
                 if kind not in offered and RANKS[kind].source in why)


def _family_draft(model: ModelSpec, info: TargetInfo, catalogue: Catalogue) -> Option:
    pair_id = next((p.id for p in catalogue.pairs.values()
                    if p.drafter is not None and p.drafter.id == model.id
                    or p.target.id == model.id), None)
    return Option("draft", f"a smaller model of the {info.family} family (same tokenizer)",
                  model, pair_id)


def recorded_tau(folder: Path) -> float | None:
    """The held-out τ a trained head's record gives, or None (published heads have none)."""
    try:
        record = json.loads((Path(folder) / HEAD_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    tau = record.get("held_out_tau") if isinstance(record, dict) else None
    return float(tau) if isinstance(tau, (int, float)) else None


def _disk_bytes(path: Path) -> int:
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _size(n: int) -> str:
    return _gb(n) if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"
