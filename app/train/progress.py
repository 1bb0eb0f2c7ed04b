"""What a head's training reports while it runs, and the terminal line that shows it.

Knows: the phases (answering prompts, training), tokens per second and the running top-1
accuracy per TTT depth. Must not know: array libraries; the trainer calls `on_progress`
with a TrainProgress, the CLI prints it, the UI renders it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO


@dataclass(frozen=True)
class TrainProgress:
    phase: str                  # "data", "train", "saved", "note"
    done: int                   # prompts answered / optimizer steps taken
    total: int
    tokens_per_s: float = 0.0
    loss: float = 0.0
    accuracy: tuple[float, ...] = ()  # running top-1 per depth (1-based in the text)
    epoch: int = 0
    message: str = ""

    def line(self) -> str:
        if self.phase in ("note", "saved"):
            return self.message
        bar = _bar(self.done, self.total)
        rate = f"{self.tokens_per_s:,.0f} tok/s"
        if self.phase == "data":  # no rate before a token is written (or all read back)
            return f"answering prompts {bar} {self.done}/{self.total}" + (
                f"  {rate}" if self.tokens_per_s > 0 else "")
        acc = " ".join(f"{a:.2f}" for a in self.accuracy)
        return (f"epoch {self.epoch} {bar} step {self.done}/{self.total}  {rate}  "
                f"loss {self.loss:.3f}  top-1 by depth {acc}")


ProgressFn = Callable[[TrainProgress], None]


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total) if total else width
    return "[" + "#" * filled + "." * (width - filled) + "]"


@dataclass
class TerminalLine:
    """Rewrites one line on a terminal (a new line per update elsewhere, at most 1/s)."""

    stream: TextIO = field(default_factory=lambda: sys.stderr)
    clock: Callable[[], float] = time.monotonic
    _last: float = 0.0

    def __call__(self, p: TrainProgress) -> None:
        live = self.stream.isatty()
        if p.phase in ("note", "saved"):
            # on a terminal the progress line is still open: end it first
            print(("\n" if live and self._last else "") + p.line(), file=self.stream, flush=True)
            self._last = 0.0
            return
        now = self.clock()
        if not live and now - self._last < 1.0 and p.done < p.total:
            return
        print(("\r" if live else "") + p.line(), end="" if live else "\n",
              file=self.stream, flush=True)
        self._last = now
