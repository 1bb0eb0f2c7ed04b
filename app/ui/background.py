"""Long work (a download, a head's training) on a thread while a handler streams its progress.

Knows: threads and a queue of progress reports, that a page only needs the newest report of a
burst, that a failure must become words in the page (the app stays up). Must not know: Gradio
components, what the work is or what its reports mean.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from app.core.types import SpecdeckError

POLL_S = 0.3  # how often a quiet worker is checked for having ended


class Background:
    """Runs job(report) on a daemon thread; iterate for its newest reports, then read `done`
    (what the job returned) or `error` (a sentence, when it raised)."""

    def __init__(self, job: Callable[[Callable[[Any], None]], Any]) -> None:
        self.done: Any = None
        self.error: str | None = None
        self._updates: queue.Queue[Any] = queue.Queue()
        self._worker = threading.Thread(target=self._work, args=(job,), name="specdeck-background",
                                        daemon=True)
        self._worker.start()

    def _work(self, job: Callable[[Callable[[Any], None]], Any]) -> None:
        try:
            self.done = job(self._updates.put)
        except SpecdeckError as error:
            self.error = str(error)
        except Exception as error:  # noqa: BLE001 - shown in the page; the app stays up
            self.error = f"{type(error).__name__}: {error}"

    def __iter__(self) -> Iterator[Any]:
        while self._worker.is_alive() or not self._updates.empty():
            try:
                latest = self._updates.get(timeout=POLL_S)
            except queue.Empty:
                continue
            while not self._updates.empty():  # show only the newest of a burst
                latest = self._updates.get()
            yield latest
