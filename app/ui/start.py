"""What `specdeck ui` loads when started without --target, and that load, in the background.

Knows: the start rule, like Ollama and LM Studio start from what is installed: --pair, else
the pair used last (the store remembers it), else the only installed pair, else the default
pair when it is installed; the store's install check; the stages a load reports (Workbench.load
and load_pair). The load holds the Workbench's `busy` from the moment it is begun, so a message
sent meanwhile waits for it (ChatHandlers) instead of finding no model. Must not know: Gradio
components (the page shows `status_html`), array libraries.
"""

from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass
from typing import Any

from app.core.types import SpecdeckError


@dataclass(frozen=True)
class StartChoice:
    """The pair to load at start (None: nothing to load) and why, in words for the header."""

    pair_id: str | None
    reason: str
    installed: tuple[str, ...]
    default_pair: str


def installed_pairs(backend: str) -> tuple[str, ...]:
    """Catalogue pairs installed for this backend that the app can run."""
    from app import store
    from app.catalogue.registry import load_catalogue

    return tuple(p.id for p in load_catalogue().pairs.values()
                 if backend in p.backends and store.is_installed(p, backend))


def choose_start(backend: str, pair: str | None = None) -> StartChoice:
    """The start rule: --pair, the pair used last, the only installed one, the default one."""
    from app.catalogue.registry import load_catalogue
    from app.store import recent

    default = load_catalogue().default_pair
    installed = installed_pairs(backend)
    last = recent.last_pair()
    if pair:
        return StartChoice(pair, "given with --pair", installed, default)
    if last in installed:
        return StartChoice(last, "used last", installed, default)
    if len(installed) == 1:
        return StartChoice(installed[0], "the only installed pair", installed, default)
    if default in installed:
        return StartChoice(default, "the default pair", installed, default)
    if installed:
        return StartChoice(None, f"{len(installed)} pairs are installed: pick one in Models and "
                           "press Load", installed, default)
    return StartChoice(None, f"nothing is installed yet: open Models and press Download for "
                       f"{default}", installed, default)


class StartLoad:
    """One pair loading on a thread; its stage and outcome for the page to show."""

    def __init__(self, bench: Any, choice: StartChoice,
                 load: Any = None) -> None:
        from app.ui.models import load_pair

        self.bench, self.choice = bench, choice
        self._load = load or load_pair
        self.stage = "waiting to start"
        self.error = ""
        self.done = threading.Event()
        self.started = time.monotonic()
        self.ended: float | None = None

    @property
    def pair_id(self) -> str:
        return self.choice.pair_id or ""

    @property
    def loading(self) -> bool:
        return not self.done.is_set()

    def begin(self) -> StartLoad:
        """Take the model now (so nothing runs on an empty one), load on a thread."""
        if not self.bench.busy.acquire(blocking=False):
            raise SpecdeckError("the model is busy: the start load cannot begin")
        self.bench.start = self
        threading.Thread(target=self._run, name="specdeck-start-load", daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            self._load(self.bench, self.pair_id, progress=self._stage)
            self.stage = "loaded"
        except Exception as error:  # noqa: BLE001 - shown in the page; the app stays up
            from app.ui.models import failure_text
            self.error = failure_text(error)
            self.stage = "failed"
        finally:
            self.ended = time.monotonic()
            self.bench.busy.release()
            self.done.set()

    def _stage(self, stage: str) -> None:
        self.stage = stage

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def status_html(self) -> str:
        """The header while loading (and after a failure): which pair, why, which stage."""
        c = self.choice
        if self.error:
            text = (f"Could not load {c.pair_id} ({c.reason}): {self.error}. Pick a pair in "
                    "Models.")
            return f'<div class="sd-model-bar" data-loaded="false">{html.escape(text)}</div>'
        text = f"Loading {c.pair_id} ({c.reason}): {self.stage}… {self.seconds():.0f} s"
        return ('<div class="sd-model-bar" data-loaded="false" data-loading="true">'
                f'{html.escape(text)}</div>')
