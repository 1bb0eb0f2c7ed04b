"""The terminal line that shows a head's training while it runs.

Knows: terminals (one rewritten line on a tty, a line a second elsewhere). Must not know:
array libraries; the trainer calls `on_progress` with a TrainProgress
(backends/train_progress.py), the CLI prints it here, the UI renders it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from backends.train_progress import TrainProgress


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
