"""Progress of a pull: values for the UI's callback, and bars for the terminal.

Knows: byte counting across the files of one pull, tqdm. Must not know: where bytes come from.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Progress:
    """One progress report: a chunk of a file, or a note (message set, file empty)."""

    pair_id: str
    model_id: str = ""
    file: str = ""
    file_done: int = 0
    file_total: int = 0
    done: int = 0  # bytes of the whole pull so far
    total: int = 0  # bytes of the whole pull (the mirror's wheel sizes are estimated)
    message: str = ""


ProgressFn = Callable[[Progress], None]


class Reporter:
    """Counts bytes across the whole pull and forwards Progress to the callback.

    `done` counts the bytes that came over the wire; the position shown moves with them and
    jumps to each model's planned end when it finishes, so the last report reads 100%: a
    mirror's wheels are compressed, so they carry fewer bytes than the file they assemble."""

    def __init__(self, pair_id: str, callback: ProgressFn) -> None:
        self.pair_id, self.callback = pair_id, callback
        self.done = self.total = self.shown = 0
        self.last = Progress(pair_id)

    def note(self, message: str) -> None:
        self.callback(Progress(self.pair_id, done=self.shown, total=max(self.total, self.shown),
                               message=message))

    def chunk(self, model_id: str, file: str, n: int, file_done: int, file_total: int) -> None:
        self.done += n
        self.shown += n
        self.last = Progress(self.pair_id, model_id, file, file_done, file_total, self.shown,
                             max(self.total, self.shown))
        self.callback(self.last)

    def settle(self, planned_end: int) -> None:
        """A model is installed: the bytes planned up to its end all count as done."""
        self.shown = max(self.shown, planned_end)
        self.total = max(self.total, self.shown)
        if self.last.file:  # nothing to settle on a pull that moved no bytes
            self.callback(replace(self.last, done=self.shown, total=self.total))


class TerminalProgress:
    """Bars on stderr: one for the whole pull, one for the current file; notes as lines."""

    def __init__(self) -> None:
        self.overall: Any = None
        self.file_bar: Any = None
        self.file = ""

    def __call__(self, p: Progress) -> None:
        from tqdm import tqdm

        if p.message:
            tqdm.write(f"specdeck: {p.message}", file=sys.stderr)
            return
        if self.overall is None:
            self.overall = tqdm(total=p.total, unit="B", unit_scale=True, desc="total",
                                position=0, file=sys.stderr)
        if p.file != self.file:
            if self.file_bar is not None:
                self.file_bar.close()
            self.file = p.file
            self.file_bar = tqdm(total=p.file_total, unit="B", unit_scale=True, leave=False,
                                 desc=p.file[-40:], position=1, file=sys.stderr)
        self.overall.total = max(p.total, p.done)
        self.overall.update(p.done - self.overall.n)
        self.file_bar.update(p.file_done - self.file_bar.n)

    def close(self) -> None:
        for bar in (self.file_bar, self.overall):
            if bar is not None:
                bar.close()
