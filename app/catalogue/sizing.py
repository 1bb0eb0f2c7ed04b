"""Memory arithmetic: weights, KV cache per token, a sliding window's rows per stream, verify
state, and what fits (servable context and streams, with and without speculation).

Knows: bytes per dtype and quantized format, the runtimes' own footprint (RUNTIME_BYTES), the
share of free memory kept back (RESERVE). Must not know: the planner's choice, array
libraries, downloads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
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
# rows a sliding layer keeps past its window during a one-row step: torch's
# DynamicSlidingWindowLayer keeps window - 1 rows and a forward of n rows adds n (so a plain
# step holds the window); MLX's WindowCache keeps window - 1 + SPARE (64, backends/mlx/rewind.py)
# so a rewind leaves a full window. A verify of k drafts adds k more (Fit.spare_rows). Not
# counted: mlx-lm's buffer growing in steps of 256 rows, as for every KV cache here, and the
# slack of torch's lean CPU forward (backends/torch/decoder.py: window + 128 slots a sliding
# layer, slots doubled as a full layer's sequence grows).
WINDOW_SPARE = {"torch": 0, "mlx": 64}


@dataclass(frozen=True)
class Sizing:
    """What one model costs in memory on one backend."""

    weights_bytes: int
    kv_bytes_per_token: int  # the full-attention layers' (every KV layer's without a window)
    context_limit: int  # the context the model was trained for
    state_bytes: int = 0  # a hybrid's recurrent state per stream, beside its KV cache
    # a windowed model's sliding layers: K and V of one row across them, and the rows they
    # keep per stream in a plain step (window + WINDOW_SPARE); a fixed cost past the window
    window_row_bytes: int = 0
    window_rows: int = 0

    def kv_bytes(self, context: int, spare: int = 0) -> int:
        """The KV one stream of `context` tokens keeps: every token in the full layers, at
        most window_rows + spare (a verify's extra rows) in the sliding ones."""
        return _stream_kv(self.kv_bytes_per_token, self.window_row_bytes, self.window_rows,
                          context, spare)


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
    # each model's sliding layers (Sizing.window_row_bytes, window_rows): a fixed cost per
    # stream beside KV per token, which counts the full layers only
    target_window_row_bytes: int = 0
    target_window_rows: int = 0
    drafter_window_row_bytes: int = 0
    drafter_window_rows: int = 0
    spare_rows: int = 0  # a verify's k drafts: the rows it adds to a window past a plain step's

    def kv_bytes(self, tokens: int, speculating: bool = True) -> int:
        """What one stream of `tokens` keeps in KV: the target's full layers per token and its
        window's rows, and (speculating) the drafter's, with a verify's spare rows."""
        spare = self.spare_rows if speculating else 0
        target = _stream_kv(self.target_kv_per_token, self.target_window_row_bytes,
                            self.target_window_rows, tokens, spare)
        return target + (_stream_kv(self.drafter_kv_per_token, self.drafter_window_row_bytes,
                                    self.drafter_window_rows, tokens, spare) if speculating else 0)

    @property
    def window_bytes(self) -> tuple[int, int]:
        """(target, drafter) bytes the sliding layers keep per stream of `context` tokens
        while speculating: beside KV per token, what a window costs each stream."""
        target, drafter = self.window_rows_kept
        return self.target_window_row_bytes * target, self.drafter_window_row_bytes * drafter

    @property
    def window_rows_kept(self) -> tuple[int, int]:
        """(target, drafter) rows each sliding layer keeps per stream of `context` tokens while
        speculating: window + WINDOW_SPARE + k, at most the context (0 without a window)."""
        def kept(rows: int) -> int:
            return min(self.context, rows + self.spare_rows) if rows else 0
        return kept(self.target_window_rows), kept(self.drafter_window_rows)

    @property
    def memory_bytes(self) -> int:
        """What serving one stream of `context` tokens with speculation takes: the runtime,
        both models' weights and both KV caches (their windows included)."""
        return (self.runtime_bytes + self.target_weights_bytes + self.drafter_weights_bytes
                + self.kv_bytes(self.context))

    @property
    def fits(self) -> bool:
        return self.streams_spec >= 1

    @property
    def target_fits(self) -> bool:
        return self.streams_plain >= 1

    def summary(self) -> str:
        if not self.target_fits:
            need = self.target_weights_bytes + self.kv_bytes(self.context, speculating=False)
            return f"target does not fit: needs {_gb(need)}, {_gb(self.usable_bytes)} usable"
        return (f"{self.max_context_plain}/{self.max_context_spec}, "
                f"{self.streams_plain}/{self.streams_spec}")

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "fits": self.fits, "memory_bytes": self.memory_bytes,
                "window_bytes": list(self.window_bytes)}

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
                *self._window_row(),
                *state,
                ("servable context", f"{self.max_context_plain} plain / "
                                     f"{self.max_context_spec} with the drafter")]


    def _window_row(self) -> list[tuple[str, str]]:
        """A windowed model's sliding layers per stream, beside KV per token (none without)."""
        (target, drafter), rows = self.window_bytes, self.window_rows_kept
        if not target and not drafter:
            return []
        kept = " / ".join(str(r) for r in rows if r)
        return [("window per stream", f"{_size(target)} target + {_size(drafter)} drafter "
                                      f"({kept} rows)")]


def _stream_kv(per_token: int, row_bytes: int, rows: int, tokens: int, spare: int) -> int:
    """One stream's KV: every token in the full layers, at most rows + spare in the sliding."""
    return per_token * tokens + (row_bytes * min(tokens, rows + spare) if rows else 0)


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
    """K and V for one token across the full-attention layers that keep KV (a hybrid's
    attention layers; a windowed model's full layers, at their own kv heads and head dim):
    layers x kv heads x head dim x 2 x size; `layers`: that many at kv_heads x head_dim
    instead (MTP layers). Keys equal to values (k_eq_v) are still cached twice."""
    if layers is not None:
        return layers * arch.kv_heads * arch.head_dim * 2 * dtype_bytes
    return (arch.full_layers * (arch.full_kv_heads or arch.kv_heads)
            * (arch.full_head_dim or arch.head_dim) * 2 * dtype_bytes)


def window_row_bytes(arch: Arch, dtype_bytes: int) -> int:
    """K and V of one row across the sliding layers: the part of a stream's KV that stops
    growing at the window."""
    return arch.sliding_layers * arch.kv_heads * arch.head_dim * 2 * dtype_bytes


def window_rows(arch: Arch, backend: str) -> int:
    """The rows a sliding layer keeps per stream in a plain step on backend (0: no window)."""
    return arch.window + WINDOW_SPARE.get(backend, 0) if arch.window else 0


def arch_sizing(arch: Arch, weights: int, backend: str, dtype: str) -> Sizing:
    """A model of this arch with these weights: its KV per token, window and state."""
    width = _kv_bytes(dtype)
    return Sizing(weights, kv_bytes_per_token(arch, width), arch.context,
                  arch.stream.bytes(width), window_row_bytes(arch, width),
                  window_rows(arch, backend))


def loaded_stream_bytes(model: Any, path: str | None, backend: str, context: int) -> int:
    """What one stream of `context` tokens of a loaded model keeps beside its weights: this
    module's KV (every token in the full layers, the window's rows in the sliding ones) and
    a hybrid's recurrent state, over the config at `path`, in the model's own dtype. Where
    the path does not read, the model's own count (`kv_bytes_per_token`: every layer at one
    geometry) times the context; 0 when neither is known."""
    own = getattr(model, "kv_bytes_per_token", None)
    fallback = own() * context if own is not None else 0
    if not path:
        return fallback
    from app.catalogue.target_info import describe

    try:
        arch = describe(path).arch
    except SpecdeckError:  # a file the planner cannot read: the model's own count stands
        return fallback
    # torch's "int4" or "gguf", MLX's "4-bit/bfloat16": the cache's own width (4 unknown)
    dtype = str(getattr(model, "dtype", "")).rsplit("/", 1)[-1]
    width = _kv_bytes(dtype) if dtype in _DTYPE_BYTES or dtype == "gguf" else GGUF_KV_BYTES
    size = Sizing(0, kv_bytes_per_token(arch, width), arch.context, arch.stream.bytes(width),
                  window_row_bytes(arch, width), window_rows(arch, backend))
    return size.kv_bytes(min(context, arch.context)) + size.state_bytes


def weights_bytes(params: int, backend: str, dtype: str, fmt: str | None,
                  file_bytes: int | None = None) -> int:
    """A GGUF on its own blocks and MLX's quantized checkpoints take their bytes on disk
    (file_bytes where known, else estimated from params); torch converts others to dtype."""
    if dtype == "gguf" or (backend == "mlx" and fmt is not None):
        return file_bytes or int(params * FORMAT_BITS.get(fmt or "", 16) / 8)
    return int(params * _DTYPE_BYTES[dtype])


def fit(target: Sizing, drafter: Sizing | None, memory: int, context: int,
        backend: str = "", device: str = "", dtype: str = "",
        verify: tuple[int, int] = (0, 0), slots: int = 0, k: int = 0) -> Fit:
    """Servable context and concurrent streams of `context` tokens, plain and speculative;
    verify: (rows, bytes) of the verify state (`verify_state`); slots: a hybrid target's
    state slots per stream (k + 1 states); k: the drafts a verify checks. A stream's KV is
    its full layers' per token and its sliding layers' window, with k spare rows while
    speculating."""
    drafter = drafter or Sizing(0, 0, target.context_limit)
    runtime = RUNTIME_BYTES.get(backend, 0)
    usable = int(memory * (1 - RESERVE)) - runtime
    room_plain = usable - target.weights_bytes
    room_spec = room_plain - drafter.weights_bytes
    limit = min(target.context_limit, drafter.context_limit)

    def plain(tokens: int) -> int:
        return target.kv_bytes(tokens)

    def spec(tokens: int) -> int:
        return target.kv_bytes(tokens, k) + drafter.kv_bytes(tokens, k)

    return Fit(backend=backend, device=device, dtype=dtype, available_bytes=memory,
               usable_bytes=usable, runtime_bytes=runtime,
               target_weights_bytes=target.weights_bytes,
               drafter_weights_bytes=drafter.weights_bytes,
               target_kv_per_token=target.kv_bytes_per_token,
               drafter_kv_per_token=drafter.kv_bytes_per_token, context_limit=limit,
               max_context_plain=_longest(room_plain, plain, target.context_limit),
               max_context_spec=_longest(room_spec, spec, limit), context=context,
               streams_plain=_streams(room_plain, plain(context) + target.state_bytes),
               streams_spec=_streams(room_spec, spec(context) + target.state_bytes + slots),
               verify_rows=verify[0], verify_bytes=verify[1], state_bytes=target.state_bytes,
               slot_bytes=slots, target_window_row_bytes=target.window_row_bytes,
               target_window_rows=target.window_rows,
               drafter_window_row_bytes=drafter.window_row_bytes,
               drafter_window_rows=drafter.window_rows, spare_rows=k)


def _longest(room: int, cost: Callable[[int], int], cap: int) -> int:
    """The longest context up to cap whose KV fits in room (cost grows with the context, by
    steps that shrink once a window is full, so a search rather than a division)."""
    if room <= 0:
        return 0
    low, high = 0, cap
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cost(mid) <= room else (low, mid - 1)
    return low


def _streams(room: int, per_stream: int) -> int:
    """Streams of per_stream bytes that fit in room."""
    return max(0, room // per_stream) if room > 0 and per_stream > 0 else 0


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
    return arch_sizing(model.arch, weights, backend, dtype)


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
               state_slots(pair.drafter_kind, pair.k, pair.target.arch, dtype), pair.k)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _size(n: int) -> str:
    return _gb(n) if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"
