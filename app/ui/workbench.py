"""What the app has loaded: one target, an optional draft model, and one engine per drafter kind.

Knows: how drafter names map to engines (every engine shares the one loaded target Model and
owns its own Session), which browser session may cancel which generation, and that one
generation at a time runs per target (the `busy` lock, next to the Gradio queue's limit).
Must not know: Gradio components, array libraries (backends load the models).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from app.core.engine import SpecEngine
from app.core.types import SpecdeckError
from app.drafters.ngram import NgramDrafter
from app.drafters.pairing import check_vocab_compatible

# what the app can build today; head kinds join once their drafters exist
BUILT_DRAFTERS = ("none", "ngram", "draft")
DRAFTER_CHOICES = ("auto", *BUILT_DRAFTERS)

EngineFactory = Callable[[str, "int | str"], SpecEngine]


class Busy(SpecdeckError):
    """The model is held by other work (a generation, a benchmark, a load or a delete)."""


@dataclass(frozen=True)
class Choice:
    """The drafter a request resolved to, and why (shown in the page)."""

    kind: str
    reason: str


class Workbench:
    """The loaded models and their engines; everything a handler needs, nothing global."""

    def __init__(self, backend: str = "auto", device: str = "auto", dtype: str = "auto",
                 default_k: int | str = 4, draft_dtype: str | None = None) -> None:
        self.backend_name, self.device, self.dtype = backend, device, dtype
        self.draft_dtype = draft_dtype or dtype
        self.default_k = default_k
        self.backend: Any = None  # the backend that loaded the models (bench builds drafters)
        self.target: Any = None
        self.draft: Any = None
        self.label = ""
        self.pair_id: str | None = None
        self.auto_kind: Choice | None = None  # a catalogue's pick, when a pair was loaded
        self.busy = threading.Lock()  # one generation per target at a time
        self._factory: EngineFactory | None = None
        self._engines: dict[tuple[str, str], SpecEngine] = {}
        self._cancels: dict[str, threading.Event] = {}
        self._cancels_lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self.target is not None

    def attach(self, target: Any, factory: EngineFactory, draft: Any = None, label: str = "",
               pair_id: str | None = None, auto_kind: Choice | None = None) -> None:
        """Install a loaded target (and draft); engines are built lazily by `factory`."""
        self.target, self.draft, self._factory = target, draft, factory
        self.label = label or getattr(target, "name", "model")
        self.pair_id, self.auto_kind = pair_id, auto_kind
        self._engines = {}

    def load(self, target_path: str, draft_path: str | None = None, label: str = "",
             pair_id: str | None = None, auto_kind: Choice | None = None) -> None:
        """Load models through the backend; the caller holds `busy` (no generation runs)."""
        from backends import load_backend

        if not os.path.exists(target_path):
            raise SpecdeckError(f"model not found: {target_path}; download it in the Models "
                                "tab or with `specdeck pull PAIR`")
        backend = load_backend(self.backend_name)
        self.unload()
        self.backend = backend
        target = backend.load(target_path, device=self.device, dtype=self.dtype)
        draft = (backend.load(draft_path, device=self.device, dtype=self.draft_dtype)
                 if draft_path else None)
        if draft is not None:
            check_vocab_compatible(target, draft)  # refused here, not at the first message
        for model in (target, draft):
            if model is not None:
                warm_up(model)

        def factory(kind: str, k: int | str) -> SpecEngine:
            if kind == "none":
                return SpecEngine(target)
            if kind == "ngram":
                return SpecEngine(target, NgramDrafter(), k=k)
            return SpecEngine(target, backend.draft_model_drafter(target, draft), k=k)

        self.attach(target, factory, draft=draft, label=label, pair_id=pair_id,
                    auto_kind=auto_kind)

    def unload(self) -> None:
        self.target = self.draft = self._factory = self.backend = None
        self._engines = {}
        self.label, self.pair_id, self.auto_kind = "", None, None

    def resolve(self, kind: str) -> Choice:
        """Turn the drafter control's value into a buildable kind, with the reason."""
        if kind == "auto":
            if self.auto_kind is not None:
                return self.auto_kind
            if self.draft is not None:
                return Choice("draft", f"auto: the draft model {self.draft.name} is loaded")
            return Choice("ngram", "auto: no draft model loaded, so prompt lookup (n-gram)")
        if kind not in BUILT_DRAFTERS:
            raise SpecdeckError(f"drafter {kind!r} needs {kind}, which this app cannot build "
                                "yet: pick auto, ngram or draft")
        if kind == "draft" and self.draft is None:
            raise SpecdeckError("drafter 'draft' needs a draft model: load a pair with a draft "
                                "model in the Models tab, or start with --draft PATH")
        return Choice(kind, "plain decoding" if kind == "none" else f"chosen: {kind}")

    def engine(self, kind: str, k: int | str) -> tuple[SpecEngine, Choice]:
        """The engine for a drafter kind and k (a number, or "auto": chosen per step).

        Built once and shared by chat and race, so a conversation's cache survives switching
        tabs; a fixed k is set on the engine here (callers hold `busy`)."""
        if self._factory is None:
            raise SpecdeckError("no model is loaded: pick a pair in the Models tab and press "
                                "Load, or start with `specdeck ui --target PATH`")
        if k != "auto" and (not isinstance(k, int) or k < 1):
            raise SpecdeckError(f"k must be auto or at least 1 (got {k!r}); pick drafter none "
                                "for plain decoding")
        choice = self.resolve(kind)
        # an auto-k engine owns a controller that learns costs, so it stays apart
        key = (choice.kind, "auto" if k == "auto" and choice.kind != "none" else "fixed")
        if key not in self._engines:
            self._engines[key] = self._factory(choice.kind, k)
        engine = self._engines[key]
        if key[1] == "fixed" and choice.kind != "none":
            engine.k = k
        return engine, choice

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


def warm_up(model: Any) -> None:
    """One short forward on a throwaway session, so the first message skips the backend's
    one-time start-up cost (kernel selection, allocator growth) instead of paying it as TTFT."""
    ids = list(model.tokenizer.encode("Hello, this warms the model up."))[:8]
    if ids:
        model.start().forward(ids, n_logits=1)
