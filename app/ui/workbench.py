"""What the app has loaded: one target, an optional draft model, and one engine for the target.

Knows: how the drafter control's value maps to a drafter (built once per kind by the factory
in app/drafters), what of the loaded models `resolve` hands to the one check of a kind
(app/drafters/kinds.py: the head the pair ships and its kind, a draft model, the target's own
MTP layers, the backend and its target's capabilities), that chat and race share the
pair's one engine and so its KV cache whatever drafter they use (the race's plain lane is a
lane of the pair's own, since both lanes run at once), which browser session may cancel which
generation, and that one generation at a time runs per target (the `busy` lock, next to the
Gradio queue's limit).
Must not know: Gradio components, array libraries (backends load the models).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from app import drafters
from app.core.engine import SpecEngine
from app.core.types import SpecdeckError
from app.pair import MAIN, LoadSpec, Pair
from app.runtime import compute

DRAFTER_CHOICES = drafters.WITH_TREES


class Busy(SpecdeckError):
    """The model is held by other work (a generation, a benchmark, a load or a delete)."""


@dataclass(frozen=True)
class Choice:
    """The drafter a request resolved to, and why (shown in the page)."""

    kind: str
    reason: str


def _pair_field(name: str, doc: str) -> property:
    """An attribute of the loaded pair, read and set through the Workbench."""
    return property(lambda self: getattr(self.pair, name),
                    lambda self, value: setattr(self.pair, name, value), doc=doc)


class Workbench:
    """The loaded models and their engines; everything a handler needs, nothing global."""

    backend = _pair_field("backend", "the backend that loaded the models (bench builds drafters)")
    target = _pair_field("target", "the loaded target, None before a load")
    draft = _pair_field("draft", "the loaded draft model, if any")
    head = _pair_field("head", "a head drafter's folder (EAGLE, DFlash, Medusa)")
    head_kind = _pair_field("head_kind", "the head's kind, where known (the pair's, the folder's)")
    mtp_layers = _pair_field("mtp_layers", "the target's own MTP layers (read at load)")
    history = _pair_field("history", "the target's history (app/store/history.py), when kept")

    def __init__(self, backend: str = "auto", device: str = "auto", dtype: str = "auto",
                 default_k: int | str = 4, draft_dtype: str | None = None,
                 history: bool = True) -> None:
        self.backend_name, self.device, self.dtype = backend, device, dtype
        self.keeps_history = history  # off under --no-history
        self.draft_dtype = draft_dtype or dtype
        self.default_k = default_k
        self.pair = Pair(None, None)  # the loaded models (app/pair.py); empty: none loaded
        self.label = ""
        self.pair_id: str | None = None
        self.auto_kind: Choice | None = None  # a catalogue's pick, when a pair was loaded
        self.remote: Any = None  # a RemoteEngine (`ui --remote`): Chat talks to that server
        self.start: Any = None  # the StartLoad (app/ui/start.py) loading a pair at start
        self.start_reason = ""  # why nothing was loaded at start, for the header
        self.busy = threading.Lock()  # one generation per target at a time
        self._cancels: dict[str, threading.Event] = {}
        self._cancels_lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self.target is not None

    @property
    def history_notice(self) -> str:
        """What the page says of the history: on and where, or off."""
        from app.store.history import root

        if not self.keeps_history:
            return "History is off (--no-history): replies are neither kept nor drafted from."
        return (f"History is on: replies are kept in {root()} and drafted from later (on "
                "this machine only); Clear history, or `specdeck cache clear`, empties it.")

    def clear_history(self) -> str:
        """Empty the whole history (every model's), on disk and in memory; what was done."""
        from app.store.history import clear_all

        if self.history is not None:
            self.history.forget()
        return f"History cleared: {clear_all()} files removed. " + self.history_notice

    def attach(self, target: Any, draft: Any = None, label: str = "",
               pair_id: str | None = None, auto_kind: Choice | None = None,
               engines: Callable[[str], Any] | None = None, pair: Pair | None = None) -> None:
        """Install a loaded target (and draft), or an opened pair; the engine and drafters are
        built lazily.

        engines(lane) builds a lane's engine (default: the pair's; tests script one).
        """
        self.pair = pair or Pair(self.backend, target, draft, engines=engines)
        self.remote = None
        # the main lane records its replies; the Race tab's plain lane repeats a reply
        self.history = _history_of(target) if self.keeps_history else None
        self.label = label or getattr(target, "name", "model")
        self.pair_id, self.auto_kind = pair_id, auto_kind

    def load(self, target_path: str, draft_path: str | None = None, label: str = "",
             pair_id: str | None = None, auto_kind: Choice | None = None,
             head: str | None = None,
             progress: Callable[[str], None] = lambda _stage: None) -> None:
        """Load models through the backend; the caller holds `busy` (no generation runs).
        progress(stage) hears each stage, for a page that shows the load as it goes. The load
        and its warm-ups run on the compute thread, as generations do (app/runtime/compute.py)."""
        compute.call(self._load, target_path, draft_path, label, pair_id, auto_kind, head,
                     progress)

    def _load(self, target_path: str, draft_path: str | None, label: str,
              pair_id: str | None, auto_kind: Choice | None, head: str | None,
              progress: Callable[[str], None]) -> None:
        self.unload()
        kind = auto_kind.kind if auto_kind is not None else None
        spec = LoadSpec(target_path, draft_path, head, backend=self.backend_name,
                        device=self.device, dtype=self.dtype, draft_dtype=self.draft_dtype,
                        head_kind=kind if kind in drafters.HEADS else None)
        pair = Pair.open(spec, progress)
        progress("warming up")
        for model in (pair.target, pair.draft):
            if model is not None:
                warm_up(model)
        self.attach(pair.target, draft=pair.draft, label=label, pair_id=pair_id,
                    auto_kind=auto_kind, pair=pair)
        # the main lane's verify costs are timed now, not inside the first message (k auto)
        self.pair.engine().warm_up()

    def attach_remote(self, engine: Any) -> None:
        """Chat through an OpenAI-compatible server instead of a local model."""
        self.unload()
        self.remote = engine
        self.label = f"{engine.kind} at {engine.base_url}"

    def unload(self) -> None:
        self.pair = Pair(None, None)
        self.label, self.pair_id, self.auto_kind = "", None, None

    def resolve(self, kind: str) -> Choice:
        """Turn the drafter control's value into a buildable kind, with the reason."""
        if kind == "auto":
            return self._runnable(self._auto())
        refusal = self.pair.check(kind)
        if refusal is not None:
            raise SpecdeckError(refusal.message)
        return Choice(kind, "plain decoding" if kind == "none" else f"chosen: {kind}")

    def _auto(self) -> Choice:
        if self.auto_kind is not None:
            built = drafters.RUN_AS.get(self.auto_kind.kind, self.auto_kind.kind)
            return Choice(built, self.auto_kind.reason)
        if self.draft is not None:
            return Choice("chain", f"auto: lookup, then the draft model {self.draft.name}")
        return Choice("ngram", "auto: no draft model loaded, so prompt lookup (n-gram)")

    def _runnable(self, choice: Choice) -> Choice:
        """auto's choice where the loaded pair runs it, else its fallback and why (the
        pair's one rule, as load_engine asks)."""
        kind, refusal = self.pair.fallback(choice.kind)
        if refusal is None:
            return choice
        return Choice(kind, f"auto: {kind} (not {choice.kind}: {refusal.reason})")

    def why_not(self, kind: str) -> str:
        """Why kind cannot run on the loaded models, or '' when it can (resolve's refusal)."""
        try:
            self.resolve(kind)
        except SpecdeckError as error:
            return str(error)
        return ""

    def engine(self, kind: str, k: int | str, lane: str = MAIN) -> tuple[Bound, Choice]:
        """The pair's engine bound to a drafter kind and k (a number, or "auto": chosen per
        step). Chat and race share the main lane's engine, so a conversation's cache
        survives switching drafter or tab; the race's plain lane runs on its own."""
        if self.target is None and self.remote is not None:
            raise SpecdeckError(f"this tab needs a local model; Chat talks to {self.label}: "
                                "load a pair in the Models tab, or start without --remote")
        if self.target is None:
            raise SpecdeckError("no model is loaded: pick a pair in the Models tab and press "
                                "Load, or start with `specdeck ui --target PATH`")
        if k != "auto" and (not isinstance(k, int) or k < 1):
            raise SpecdeckError(f"k must be auto or at least 1 (got {k!r}); pick drafter none "
                                "for plain decoding")
        choice = self.resolve(kind)
        drafter = compute.call(self.pair.drafter, choice.kind)  # a head loads its weights
        return Bound(self.pair.engine(lane), drafter, 0 if choice.kind == "none" else k), choice

    def begin(self, session: str) -> threading.Event:
        """A fresh cancel flag for one browser session's generation."""
        event = threading.Event()
        with self._cancels_lock:
            self._cancels[session] = event
        return event

    def end(self, session: str, event: threading.Event) -> None:
        with self._cancels_lock:
            if self._cancels.get(session) is event:
                del self._cancels[session]

    def cancel(self, session: str) -> bool:
        """Ask the session's running generation to stop after its current step."""
        with self._cancels_lock:
            event = self._cancels.get(session)
        if event is not None:
            event.set()
        return event is not None

    @contextmanager
    def hold(self, session: str | None = None) -> Iterator[threading.Event]:
        """Hold the model for one piece of work; released on every exit, exception or not.

        Raises Busy, taking nothing, when other work holds it. Yields the session's cancel
        flag (Stop and a closed tab set it); without a session nobody can cancel the work."""
        if not self.busy.acquire(blocking=False):
            raise Busy("the model is busy with other work (a generation, a benchmark or a "
                       "load): wait for it to end, or press Stop on the generation")
        cancel = self.begin(session) if session is not None else threading.Event()
        try:
            yield cancel
        finally:
            if session is not None:
                self.end(session, cancel)
            self.busy.release()

    def memory(self) -> dict[str, int]:
        """Bytes: weights of the loaded models, this process now and the device's peak."""
        import psutil

        weights = sum(m.weights_bytes() for m in (self.target, self.draft) if m is not None)
        peak = self.target.peak_memory_bytes() if self.target is not None else 0
        return {"weights": weights, "rss": psutil.Process().memory_info().rss, "peak": peak}


@dataclass(frozen=True)
class Bound:
    """The shared engine with one drafter and k: what a tab generates with."""

    engine: SpecEngine
    drafter: Any
    k: int | str

    @property
    def target(self) -> Any:
        return self.engine.target

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        self.engine.check_prompt(prompt_ids)

    def generate(self, prompt_ids: Sequence[int], params: Any,
                 cancel: threading.Event | None = None) -> Iterator[Any]:
        return compute.steps(self.engine.generate(prompt_ids, params, cancel,
                                                  drafter=self.drafter, k=self.k))


def warm_up(model: Any) -> None:
    """One short forward on a throwaway session, so the first message skips the backend's
    one-time start-up cost (kernel selection, allocator growth) instead of paying it as TTFT."""
    ids = list(model.tokenizer.encode("Hello, this warms the model up."))[:8]
    if ids:
        model.start().forward(ids, n_logits=1)


def _history_of(target: Any) -> Any:
    """The target's tokenizer's history, or None for a target without a vocabulary."""
    from app.store.history import open_history

    tokenizer = getattr(target, "tokenizer", None)
    return open_history(tokenizer) if hasattr(tokenizer, "get_vocab") else None
