"""The one thread that runs a process's model work.

Knows: that OpenMP, which runs torch's CPU ops and specdeck's own kernels, keeps a team of
threads for each thread that calls it, and that two teams on the same cores slow each other
for the rest of the process (Qwen2.5-Coder-1.5B, one-row forward on 2 cores: 50 ms when one
thread has ever computed, 66-78 ms on both threads once a second one has). So loads, warm-ups
and every step of a generation run here, whichever thread asks. Must not know: models,
engines, surfaces, array libraries.

Jobs run one at a time, in the order asked. A job must not wait on another thread that may
be waiting on this one: loads and steps only compute.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
THREAD_NAME = "specdeck-compute"

_jobs: queue.SimpleQueue[tuple[Future, Callable[[], Any]]] = queue.SimpleQueue()
_started = threading.Lock()
_thread: threading.Thread | None = None
_END = object()


def call(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on the compute thread: its result, or its exception raised here.
    On the compute thread itself it runs at once (a job may call another)."""
    if threading.current_thread() is _thread:
        return fn(*args, **kwargs)
    future: Future = Future()
    _jobs.put((future, lambda: fn(*args, **kwargs)))
    _start()
    return future.result()


def steps(items: Iterator[T]) -> Iterator[T]:
    """items' elements, each computed on the compute thread; closing this closes items there.
    A caller that interleaves two of these (the race's lanes) keeps its own order."""
    try:
        while (item := call(next, items, _END)) is not _END:
            yield item
    finally:
        call(_close, items)


def quiet(timeout: float) -> bool:
    """Wait until every job asked before this call has ended; False after timeout seconds.
    Before a process exits: a daemon thread still inside torch then aborts the process."""
    if _thread is None or threading.current_thread() is _thread:
        return True
    future: Future = Future()
    _jobs.put((future, lambda: None))
    try:
        future.result(timeout=timeout)
    except TimeoutError:
        return False
    return True


def _close(items: Iterator[Any]) -> None:
    close = getattr(items, "close", None)
    if close is not None:
        close()


def _start() -> None:
    global _thread
    with _started:
        if _thread is None:
            _thread = threading.Thread(target=_work, name=THREAD_NAME, daemon=True)
            _thread.start()


def _work() -> None:
    while True:
        future, job = _jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(job())
        except BaseException as error:  # noqa: BLE001 - handed to the caller, who raises it
            future.set_exception(error)
