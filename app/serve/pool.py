"""`specdeck serve` without --target: every installed pair, served by its id, the way Ollama does.

Knows: which pairs are listed (built by the caller from the store and the planner), what each
needs in memory (the planner's sizing for one stream of NEED_CONTEXT tokens), the budget they
share (bytes, and optionally a count), the keep-alive rule (Ollama's keep_alive: a duration
such as "5m" or a number of seconds; 0 unloads when the request ends; negative keeps the model
loaded), and which loaded pairs are in use by a request. Must not know: HTTP frameworks, OpenAI
shapes beyond its 404, array libraries: a `load(pair_id)` callable builds the served engine.

A request acquires a pair (loading it on first use, after unloading idle pairs, least
recently used first, until the planner says it fits) and releases it when its generation
ends. A pair in use is never unloaded; a load that needs its memory waits for the release.
"""

import gc
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.catalogue import sizing
from app.core.types import SpecdeckError
from app.serve.requests import ApiError, shown

NEED_CONTEXT = 4096  # the stream a pair is sized for, as `specdeck models` sizes it
DEFAULT_KEEP_ALIVE = "5m"  # Ollama's default
REAP_EVERY_S = 1.0  # how often idle pairs are looked at
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any, what: str = "keep_alive") -> float:
    """Seconds from a keep-alive: a number of seconds or a Go-style duration ("5m", "1h30m",
    "90s"); negative means forever (math.inf)."""
    if isinstance(value, bool):
        raise SpecdeckError(f"{what} takes a duration like 5m or a number of seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        parts = _DURATION.findall(body)
        if body.replace(".", "", 1).isdigit():
            seconds = sign * float(body)
        elif parts and "".join(n + u for n, u in parts) == body:
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
        else:
            raise SpecdeckError(f"{what} {shown(value)} is not a duration: write e.g. 5m, 30s, "
                                "1h, 0 (unload at once) or -1 (keep loaded)")
    return float("inf") if seconds < 0 else seconds


def need_bytes(fit: sizing.Fit, context: int = NEED_CONTEXT) -> int:
    """Weights of the target and drafter, and their KV cache for one stream of `context`
    (a sliding window's rows included)."""
    tokens = min(context, fit.context_limit or context)
    return fit.target_weights_bytes + fit.drafter_weights_bytes + fit.kv_bytes(tokens)


@dataclass(frozen=True)
class Listed:
    """An installed pair as /v1/models shows it, and what it needs loaded."""

    pair_id: str
    name: str
    drafter: str  # the planner's choice, e.g. "ngram" or "draft qwen2.5-0.5b-instruct"
    drafter_reason: str
    need_bytes: int
    context: int


class _Entry:
    def __init__(self, listed: Listed, keep_alive_s: float) -> None:
        self.listed = listed
        self.served: Any = None
        self.refs = 0
        self.last_used = 0.0
        self.keep_alive_s = keep_alive_s


class Pool:
    """Loaded pairs within a memory budget; loads on first use, unloads idle ones."""

    def __init__(self, listed: list[Listed], load: Callable[[str], Any], budget_bytes: int,
                 keep_alive_s: float, max_loaded: int = 0, runtime_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda _line: None) -> None:
        self._entries = {item.pair_id: _Entry(item, keep_alive_s) for item in listed}
        self._load, self._clock, self._log = load, clock, log
        self.budget_bytes = budget_bytes
        # as the planner counts it: RESERVE kept back, and the process's own runtime
        self.usable_bytes = int(budget_bytes * (1 - sizing.RESERVE)) - runtime_bytes
        self.max_loaded = max_loaded
        self._state = threading.Condition()  # entries' served/refs/last_used
        self._loading = threading.Lock()  # one load at a time
        self._stop = threading.Event()

    # ---- what is here -----------------------------------------------------------------

    @property
    def listed(self) -> list[Listed]:
        return [e.listed for e in self._entries.values()]

    def loaded(self) -> list[str]:
        with self._state:
            return [pid for pid, e in self._entries.items() if e.served is not None]

    def served(self, pair_id: str) -> Any:
        """The loaded engine of a pair, or None."""
        with self._state:
            return self._entries[pair_id].served

    # ---- requests ----------------------------------------------------------------------

    def acquire(self, model: str | None) -> Any:
        """The served pair a request names, loaded if need be; release it when done."""
        entry = self._entry(model)
        with self._state:
            if entry.served is not None:
                entry.refs += 1
                return entry.served
        with self._loading:
            with self._state:
                if entry.served is not None:  # loaded while this request waited its turn
                    entry.refs += 1
                    return entry.served
                self._make_room(entry)
            self._log(f"loading {entry.listed.pair_id} (drafter {entry.listed.drafter})")
            served = self._load_or_explain(entry.listed.pair_id)
            with self._state:
                entry.served, entry.refs, entry.last_used = served, entry.refs + 1, self._clock()
                self._state.notify_all()
            return served

    def _load_or_explain(self, pair_id: str) -> Any:
        """The loader's result; a failure becomes a 500 naming the pair (the server stays up,
        the pair stays unloaded, the next request tries again)."""
        try:
            return self._load(pair_id)
        except Exception as error:  # noqa: BLE001 - any loader failure, reported to the client
            text = str(error) if isinstance(error, SpecdeckError) else (
                f"{type(error).__name__}: {error}")
            self._log(f"could not load {pair_id}: {text}")
            raise ApiError(f"could not load {pair_id}: {text}", "model", 500, "model_load_failed",
                           kind="server_error") from error

    def release(self, pair_id: str, keep_alive: Any = None) -> None:
        """A request on the pair ended; its keep_alive, when given, applies from now on."""
        entry = self._entries[pair_id]
        with self._state:
            entry.refs -= 1
            entry.last_used = self._clock()
            if keep_alive is not None:
                entry.keep_alive_s = parse_duration(keep_alive)
            if entry.refs == 0 and entry.keep_alive_s == 0:
                self._unload(entry, "keep_alive 0")
            self._state.notify_all()

    def check_keep_alive(self, keep_alive: Any) -> None:
        """Refuse a malformed keep_alive before any work (400, naming the fix)."""
        if keep_alive is not None:
            try:
                parse_duration(keep_alive)
            except SpecdeckError as error:
                raise ApiError(str(error), "keep_alive") from error

    def _entry(self, model: str | None) -> _Entry:
        if model is None:  # the one installed pair, else the one loaded, as a default
            entries = list(self._entries.values())
            loaded = [e for e in entries if e.served is not None]
            for candidates in (entries, loaded):
                if len(candidates) == 1:
                    return candidates[0]
            raise ApiError(f"name the model: one of {', '.join(self._entries)}", "model")
        entry = self._entries.get(model)
        if entry is None:
            raise ApiError(_missing(model, list(self._entries)), "model", 404,
                           "model_not_found")
        return entry

    # ---- memory ------------------------------------------------------------------------

    def _fits(self, entry: _Entry, loaded: list[_Entry]) -> bool:
        if self.max_loaded and len(loaded) >= self.max_loaded:
            return False
        used = sum(e.listed.need_bytes for e in loaded)
        return used + entry.listed.need_bytes <= self.usable_bytes

    def _make_room(self, entry: _Entry) -> None:
        """Unload idle pairs, least recently used first, until the planner's sizes fit;
        wait for busy ones to be released. Called holding _state."""
        while True:
            loaded = [e for e in self._entries.values() if e.served is not None]
            if not loaded or self._fits(entry, loaded):
                if not loaded and entry.listed.need_bytes > self.usable_bytes:
                    self._log(f"warning: {entry.listed.pair_id} needs "
                              f"{entry.listed.need_bytes / 1e9:.2f} GB, more than the "
                              f"{self.usable_bytes / 1e9:.2f} GB usable; loading it alone")
                return
            idle = sorted((e for e in loaded if e.refs == 0), key=lambda e: e.last_used)
            if idle:
                self._unload(idle[0], f"to make room for {entry.listed.pair_id}")
            else:
                self._state.wait(REAP_EVERY_S)

    def _unload(self, entry: _Entry, why: str) -> None:
        entry.served = None
        self._log(f"unloaded {entry.listed.pair_id} ({why})")
        gc.collect()  # the engine's weights and KV cache go now, not at some later collection

    # ---- keep-alive --------------------------------------------------------------------

    def reap(self) -> list[str]:
        """Unload every pair idle longer than its keep-alive; returns their ids."""
        now = self._clock()
        gone = []
        with self._state:
            for entry in self._entries.values():
                if (entry.served is not None and entry.refs == 0
                        and now - entry.last_used >= entry.keep_alive_s):
                    self._unload(entry, f"idle for {now - entry.last_used:.0f} s")
                    gone.append(entry.listed.pair_id)
            if gone:
                self._state.notify_all()
        return gone

    def start_reaper(self) -> None:
        def loop() -> None:
            while not self._stop.wait(REAP_EVERY_S):
                self.reap()

        threading.Thread(target=loop, name="specdeck-keep-alive", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()


def _missing(model: str, installed: list[str]) -> str:
    """The 404 for a model that is not installed, naming the pull that fixes it."""
    try:
        from app.catalogue.registry import load_catalogue
        known = model in load_catalogue().pairs
    except SpecdeckError:
        known = False
    here = ", ".join(installed) or "none"
    if known:
        return (f"the model {shown(model)} is not installed: run `specdeck pull {model}`, then "
                f"ask again (installed: {here})")
    return (f"the model {shown(model)} does not exist: this server serves the installed pairs "
            f"({here}); `specdeck models` lists the catalogue and `specdeck pull <id>` "
            "installs one")
