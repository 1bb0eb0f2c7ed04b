"""Batched streams: one scheduler per loaded target steps every live generation together.

Knows: SpecEngine's generations as coroutines (engine.steps: events, and the ForwardCalls
they need), a model's forward_batch (BatchForward: every stream's rows in one forward), the
compute thread (app/runtime/compute.py), slots (one SpecEngine each over the shared target:
its own session, so its own KV cache and states, its own drafters and k controllers),
cancellation. Must not know: HTTP, reply shapes, array libraries, how drafters are built
(a `build(kind)` callable makes a slot's own).

Each tick, on the compute thread: waiting requests take free slots (the one whose cache
shares the longest prefix with the prompt, as llama-server picks a slot); every live
generation runs until it asks for a forward; the forwards run as one; each answer goes
back. Drafting, verification, keep and accept stay per stream, so a stream's greedy tokens
are its solo tokens under any load, wherever the backend gives a row the same bits in any
forward (backends/torch/exactness.py). A long prompt is fed in PREFILL_CHUNK-row pieces
while other streams decode, so it never stalls them for its whole prefill. A request
beyond the slots waits here, in order; the admission gate (app/serve/admission.py) bounds
how many may wait.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from app.core.adaptive import Load
from app.core.engine import Event, Forwarded, SpecEngine, Steps
from app.core.protocols import BatchForward, Drafter, ForwardCall, TargetOutput
from app.core.types import Done, RunStats, SamplingParams, common_prefix_length
from app.runtime import compute

PREFILL_CHUNK = 32  # prompt rows per tick while other streams decode
_END = None


@dataclass
class Request:
    """One generation asked of the scheduler; its events arrive on `events()`."""

    prompt_ids: list[int]
    params: SamplingParams
    drafter: str  # the kind, built per slot
    k: int | str
    partition: str
    cancel: threading.Event
    bind: Callable[[Drafter, str], Drafter] | None = None  # a drafter for the partition
    _out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def events(self) -> Iterator[Event]:
        """Its events in order, until its Done; blocks between them."""
        while (event := self._out.get()) is not _END:
            yield event


@dataclass
class _Live:
    """A request in a slot: its generation and the forward it waits on."""

    slot: int
    request: Request
    steps: Steps
    call: ForwardCall | None = None  # what it waits for; a prompt's remainder while chunked
    reply: Forwarded | None = None
    error: Exception | None = None
    fed_s: float = 0.0  # seconds of a chunked prompt's earlier pieces
    rows: int = 0  # its rows in the last forward


@dataclass(frozen=True)
class Capacity:
    """How many streams fit, and why: the slots, each a session of `context` tokens; and
    how many streams of `context` memory holds with speculation (the draft model's KV beside
    each) and without (the target's alone), None where the memory is not known."""

    slots: int
    context: int
    reason: str
    fit_speculating: int | None = None
    fit_plain: int | None = None

    def summary(self) -> str:
        """The startup line's figures: what runs, and what memory would hold either way."""
        line = f"{self.slots} stream(s) at once, {self.context} tokens each ({self.reason})"
        if self.fit_speculating is not None and self.fit_plain is not None:
            line += (f"; memory holds {self.fit_speculating} with speculation, "
                     f"{self.fit_plain} without")
        return line


class Streams:
    """The scheduler of one target's slots (`engines`, sharing the target's weights)."""

    def __init__(self, engines: Sequence[SpecEngine], build: Callable[[str], Drafter],
                 default: tuple[str, Drafter] | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, capacity: Capacity | None = None
                 ) -> None:
        if not engines:
            raise ValueError("a scheduler needs at least one slot")
        self.engines = list(engines)
        self.capacity = capacity or Capacity(len(engines), engines[0].target.context_length,
                                             f"{len(engines)} slot(s) asked")
        self._build = build
        # each slot's drafters by kind; the first slot's engine keeps the loaded one
        self._drafters: list[dict[str, Drafter]] = [{} for _ in engines]
        if default is not None:
            self._drafters[0][default[0]] = default[1]
        self._chunk = prefill_chunk
        self._waiting: list[Request] = []
        self._live: list[_Live] = []
        self._free = list(range(len(engines)))
        self._cv = threading.Condition()
        self._last = Load()  # every stream's share of the last forward: streams, rows
        self.batches = 0
        self.batched_rows = 0
        self.draft_batches = 0  # forwards of a draft model, every stream's drafts in each
        self.draft_rows = 0
        self._stopped = False
        self._driving = False  # a driver thread runs; it ends when no stream is left

    @property
    def slots(self) -> int:
        return len(self.engines)

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def last_load(self) -> Load:
        """The last forward's streams and rows (every stream's)."""
        return self._last

    def submit(self, request: Request) -> Request:
        """Queue a generation; it starts when a slot is free."""
        with self._cv:
            if self._stopped:
                raise RuntimeError("the scheduler is stopped")
            self._waiting.append(request)
            if not self._driving:
                self._driving = True
                threading.Thread(target=self._drive, name="specdeck-streams",
                                 daemon=True).start()
        return request

    def stop(self) -> None:
        """Refuse new requests; the live ones run on (their cancel events end them)."""
        with self._cv:
            self._stopped = True

    def _drive(self) -> None:
        """Tick while any stream lives or waits, then end (a process at exit waits for
        specdeck's threads: an idle one must not be left)."""
        while True:
            with self._cv:
                if not (self._waiting or self._live):
                    self._driving = False
                    return
            compute.call(self._tick)

    def _tick(self) -> None:
        """Admit, advance every live stream to its next forward, run the forwards as one."""
        self._admit()
        for live in list(self._live):
            self._advance(live)
        if self._live:
            self._forward([live for live in self._live if live.call is not None])

    def _admit(self) -> None:
        with self._cv:
            waiting, self._waiting = self._waiting, []
        kept = []
        for request in waiting:
            if request.cancel.is_set():
                request._out.put(_END)  # it left the queue before it ran
            elif self._free:
                self._start(request)
            else:
                kept.append(request)
        with self._cv:
            self._waiting = kept + self._waiting

    def _start(self, request: Request) -> None:
        slot = max(self._free, key=lambda i: common_prefix_length(
            self.engines[i].session.tokens, request.prompt_ids))
        self._free.remove(slot)
        engine = self.engines[slot]
        try:
            drafter = self._drafter(slot, request)
            steps = engine.steps(request.prompt_ids, request.params, request.cancel,
                                 drafter=drafter, k=request.k, partition=request.partition)
        except Exception as error:  # noqa: BLE001 - a drafter that cannot be built
            self._refuse(slot, request, error)
            return
        self._live.append(_Live(slot, request, steps))

    def _drafter(self, slot: int, request: Request) -> Drafter:
        mine = self._drafters[slot]
        if request.drafter not in mine:
            mine[request.drafter] = self._build(request.drafter)
        drafter = mine[request.drafter]
        return request.bind(drafter, request.partition) if request.bind else drafter

    def _refuse(self, slot: int, request: Request, error: Exception) -> None:
        request._out.put(Done(text="", token_ids=(), stop_reason="error", stats=RunStats(),
                              error=f"{type(error).__name__}: {error}"))
        request._out.put(_END)
        self._free.append(slot)

    def _advance(self, live: _Live) -> None:
        """Run one generation until it asks for a forward (or ends)."""
        if live.call is not None:
            return  # a chunked prompt still feeding
        engine = self.engines[live.slot]
        engine.load = Load(streams=max(self._last.streams - (1 if live.rows else 0), 0),
                           rows=max(self._last.rows - live.rows, 0))
        while True:
            try:
                item = (live.steps.throw(live.error) if live.error is not None
                        else live.steps.send(live.reply))
            except StopIteration:
                self._end(live)
                return
            except Exception as error:  # noqa: BLE001 - refused before it began (a prompt)
                live.request._out.put(Done(text="", token_ids=(), stop_reason="error",
                                           stats=RunStats(),
                                           error=f"{type(error).__name__}: {error}"))
                self._end(live)
                return
            live.reply, live.error = None, None
            if isinstance(item, ForwardCall):
                live.call = item
                return
            live.request._out.put(item)

    def _end(self, live: _Live) -> None:
        live.steps.close()
        live.request._out.put(_END)
        self._live.remove(live)
        self._free.append(live.slot)

    def _forward(self, lives: list[_Live]) -> None:
        """The waiting forwards as one per model (the target's verifies, a draft model's
        drafts); a prompt over PREFILL_CHUNK rows runs a piece of itself while other
        streams share the tick."""
        if not lives:
            return
        target = self.engines[0].target
        groups: dict[int, tuple[Any, list[_Live]]] = {}
        for live in lives:
            model = live.call.model if live.call is not None and live.call.model is not None \
                else target
            groups.setdefault(id(model), (model, []))[1].append(live)
        for model, group in groups.values():
            self._forward_group(model, group, len(lives) > 1, model is target)

    def _forward_group(self, model: Any, lives: list[_Live], shared: bool, target: bool
                       ) -> None:
        calls = [self._piece(live, shared) for live in lives]
        t0 = time.perf_counter()
        outs, error = _run(model, calls)
        seconds = time.perf_counter() - t0
        rows = sum(len(call.token_ids) for call in calls)
        if target:  # the load the k controllers price: the target's forward
            self._last = Load(streams=len(calls), rows=rows)
            self.batches += 1
            self.batched_rows += rows
        else:
            self.draft_batches += 1
            self.draft_rows += rows
        for live, call, out in zip(lives, calls, outs or [None] * len(calls)):
            if target:
                live.rows = len(call.token_ids)
            self._answer(live, call, out, error, seconds, rows)

    def _piece(self, live: _Live, shared: bool) -> ForwardCall:
        call = live.call
        assert call is not None
        if not shared or len(call.token_ids) <= self._chunk or call.capture or call.parents \
                or call.n_logits != 1:
            return call
        return replace(call, token_ids=call.token_ids[:self._chunk])

    def _answer(self, live: _Live, call: ForwardCall, out: TargetOutput | None,
                error: Exception | None, seconds: float, rows: int) -> None:
        whole = live.call
        assert whole is not None
        if error is None and len(call.token_ids) < len(whole.token_ids):
            live.call = replace(whole, token_ids=whole.token_ids[len(call.token_ids):])
            live.fed_s += seconds
            return
        live.call = None
        if error is not None:
            live.error = error
        else:
            assert out is not None
            live.reply = Forwarded(out, live.fed_s + seconds, rows)
        live.fed_s = 0.0


def _run(model: Any, calls: list[ForwardCall]
         ) -> tuple[list[TargetOutput] | None, Exception | None]:
    """The calls as one forward where the target batches them, else each alone; an error
    is every call's (a batch that fails is not retried: its sessions moved on)."""
    try:
        if len(calls) > 1 and isinstance(model, BatchForward):
            return model.forward_batch(calls), None
        return [call.run() for call in calls], None
    except Exception as error:  # noqa: BLE001 - raised inside each generation
        return None, error


def capacity(slots_asked: int, per_stream_bytes: int, free_bytes: int, context: int,
             plain_stream_bytes: int | None = None) -> Capacity:
    """The slots a server runs: what was asked (--parallel), at most what memory holds of
    streams of `context` tokens, and at least one. plain_stream_bytes: a stream's bytes with
    speculation off (the target's KV alone), for the figure without it."""
    fit = free_bytes // per_stream_bytes if per_stream_bytes > 0 else slots_asked
    slots = max(1, min(slots_asked, fit))
    reason = (f"--parallel {slots_asked}" if slots == slots_asked else
              f"memory holds {fit} stream(s) of {context} tokens")
    plain = plain_stream_bytes if plain_stream_bytes is not None else per_stream_bytes
    known = per_stream_bytes > 0 and plain > 0
    return Capacity(slots=slots, context=context, reason=reason,
                    fit_speculating=fit if known else None,
                    fit_plain=free_bytes // plain if known else None)


def fork_engines(engine: SpecEngine, slots: int) -> list[SpecEngine]:
    """The engine and slots - 1 more over its target, each with a session of its own,
    sharing its probed verify costs and recorder."""
    engines = [engine]
    for _ in range(slots - 1):
        twin = SpecEngine(engine.target, None, k=0, k_max=engine.k_max_default,
                          recorder=engine.recorder)
        twin.share_costs(engine)
        engines.append(twin)
    return engines

