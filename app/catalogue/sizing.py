"""Memory arithmetic: weights, KV cache per token, verify state, and what fits (servable context
and streams, with and without speculation).

Knows: bytes per dtype and quantized format, the runtimes' own footprint (RUNTIME_BYTES), the
share of free memory kept back (RESERVE). Must not know: the planner's choice, array
libraries, downloads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from app.catalogue.hardware import dtype_for, resolve_device
from app.catalogue.preference import NO_KV_CACHE, PER_DRAFTER_LAYER, RANKS, SHIPPED
from app.catalogue.registry import FORMAT_BITS, Arch, ModelSpec, PairSpec
from app.catalogue.target_info import TargetInfo
from app.core.types import SpecdeckError

RESERVE = 0.10  # share of free memory kept for activations, verify buffers and the runtime
LOGIT_BYTES = 4  # the verify keeps each row's logits in float32 for the sampler
# bytes per weight; int4 and w4a8: 4-bit codes and a bf16 scale and zero per 32
# (backends/torch/quantized_linear.py Int4Linear, backends/torch/w4a8.py); gguf: the file's
# own bytes
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "w8a8": 1, "int4": 0.625,
                "w4a8": 0.625}
QUANTIZED = ("w8a8", "int4", "w4a8")  # quantized weights, bf16 KV cache
GGUF_KV_BYTES = 4  # a GGUF computes in float32 between its matmuls, its KV cache included
# resident memory of a process before any weights: Python, the array library, transformers and
# the server (after importing app.serve.server here: 383 MiB with torch, 268 MiB with MLX's
# Linux CPU build)
RUNTIME_BYTES = {"torch": 400 * 2**20, "mlx": 270 * 2**20}


@dataclass(frozen=True)
class Sizing:
    """What one model costs in memory on one backend."""

    weights_bytes: int
    kv_bytes_per_token: int
    context_limit: int  # the context the model was trained for
    state_bytes: int = 0  # a hybrid's recurrent state per stream, beside its KV cache


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
    # a hybrid target's recurrent state per stream, and the k + 1 state slots a verify adds
    # to it (app/catalogue/states.py): both counted per stream in streams_spec
    state_bytes: int = 0
    slot_bytes: int = 0

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
        # a hybrid target's recurrent state and slots, beside KV per token
        state = [("state per stream", f"{_size(self.state_bytes)} + {_size(self.slot_bytes)} "
                                      f"slots ({self.verify_rows})")] if self.state_bytes else []
        return [("target weights", _size(self.target_weights_bytes)),
                ("drafter weights", _size(self.drafter_weights_bytes)),
                ("verify state", verify),
                ("KV per token", f"{_kib(self.target_kv_per_token)} target + "
                                 f"{_kib(self.drafter_kv_per_token)} drafter"),
                *state,
                ("servable context", f"{self.max_context_plain} plain / "
                                     f"{self.max_context_spec} with the drafter")]


def _kv_bytes(dtype: str) -> int:
    # quantized modes quantize weights only: their KV cache is bf16
    if dtype == "gguf":
        return GGUF_KV_BYTES
    return 2 if dtype in QUANTIZED else _DTYPE_BYTES[dtype]


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
    """K and V for one token across the layers that keep KV (a hybrid's attention layers):
    layers x kv heads x head dim x 2 x size."""
    every = arch.kv_layers or arch.layers
    return (every if layers is None else layers) * arch.kv_heads * arch.head_dim * 2 \
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
        verify: tuple[int, int] = (0, 0), slots: int = 0) -> Fit:
    """Servable context and concurrent streams of `context` tokens, plain and speculative;
    verify: (rows, bytes) of the verify state (`verify_state`); slots: a hybrid target's
    state slots per stream (k + 1 states)."""
    drafter = drafter or Sizing(0, 0, target.context_limit)
    runtime = RUNTIME_BYTES.get(backend, 0)
    usable = int(memory * (1 - RESERVE)) - runtime
    room_plain = usable - target.weights_bytes
    room_spec = room_plain - drafter.weights_bytes
    kv_spec = target.kv_bytes_per_token + drafter.kv_bytes_per_token
    limit = min(target.context_limit, drafter.context_limit)

    def longest(room: int, per_token: int, cap: int) -> int:
        return max(0, min(cap, room // per_token)) if room > 0 else 0

    def streams(room: int, per_token: int, state: int) -> int:
        return max(0, room // (per_token * context + state)) if room > 0 else 0

    return Fit(backend=backend, device=device, dtype=dtype, available_bytes=memory,
               usable_bytes=usable, runtime_bytes=runtime,
               target_weights_bytes=target.weights_bytes,
               drafter_weights_bytes=drafter.weights_bytes,
               target_kv_per_token=target.kv_bytes_per_token,
               drafter_kv_per_token=drafter.kv_bytes_per_token, context_limit=limit,
               max_context_plain=longest(room_plain, target.kv_bytes_per_token,
                                         target.context_limit),
               max_context_spec=longest(room_spec, kv_spec, limit), context=context,
               streams_plain=streams(room_plain, target.kv_bytes_per_token, target.state_bytes),
               streams_spec=streams(room_spec, kv_spec, target.state_bytes + slots),
               verify_rows=verify[0], verify_bytes=verify[1], state_bytes=target.state_bytes,
               slot_bytes=slots)


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


def state_slots(kind: str, k: int, target_arch: Arch, dtype: str) -> int:
    """What a verify of k drafts adds to a hybrid target's state per stream: k + 1 slots (0
    for an attention-only target, or plain decoding)."""
    return target_arch.stream.slot_bytes(k, _kv_bytes(dtype)) if kind != "none" else 0


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
    return Sizing(weights, kv_bytes_per_token(model.arch, _kv_bytes(dtype)), model.arch.context,
                  model.arch.stream.bytes(_kv_bytes(dtype)))


def drafter_sizing(kind: str, model: ModelSpec | None, target_arch: Arch, backend: str,
                   dtype: str) -> Sizing | None:
    """MTP layers live in the target's weights but keep their own KV cache; Medusa's heads
    keep none (each is an MLP on the target's last hidden state), nor does Gemma 4's assistant
    (it reads the target's)."""
    if kind == "mtp":
        return Sizing(0, kv_bytes_per_token(target_arch, _kv_bytes(dtype),
                                            target_arch.mtp_layers), target_arch.context)
    if model is None:
        return None
    sizing = model_sizing(model, backend, dtype, draft=kind == "draft")
    if kind in NO_KV_CACHE:
        return Sizing(sizing.weights_bytes, 0, sizing.context_limit)
    return sizing


def pair_fit(pair: PairSpec, backend: str, device: str, memory: int, context: int) -> Fit:
    device = resolve_device(backend, device)
    dtype = dtype_for(backend, device, source_format(pair.target, backend))
    drafter = drafter_sizing(pair.drafter_kind, pair.drafter, pair.target.arch, backend, dtype)
    verify = verify_state(pair.drafter_kind, pair.k, pair.target.arch,
                          pair.drafter.arch if pair.drafter else None, dtype)
    return fit(model_sizing(pair.target, backend, dtype), drafter, memory, context,
               backend, device, dtype, verify,
               state_slots(pair.drafter_kind, pair.k, pair.target.arch, dtype))


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _size(n: int) -> str:
    return _gb(n) if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"
