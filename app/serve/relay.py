"""The run relay: one generation on its own worker thread, its events handed to the event loop.

Knows: engine.generate's Step and Done events, engine.lock, the compute thread, cancellation.
Must not know: HTTP or the reply shapes.
"""

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from app.core.types import Done, RunStats, Step
from app.runtime import compute
from app.serve.admission import Ticket
from app.serve.jobs import Job, Served

LOCK_POLL_S = 0.05  # a queued worker looks at its cancel flag this often while it waits


class Run:
    """One generation on a worker thread; its events reach the event loop through a queue."""

    def __init__(self, served: Served, job: Job, ticket: Ticket | None = None,
                 on_end: Any = None) -> None:
        self.served, self.job = served, job
        self.on_end = on_end  # called once the generation is over (a pool releases the pair)
        self.cancel = threading.Event()
        self.ticket = ticket or served.gate.admit()
        self.ticket.watch(self.cancel)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Step | Done | None] = asyncio.Queue()
        threading.Thread(target=self._work, name="specdeck-generate", daemon=True).start()

    async def events(self) -> AsyncIterator[Step | Done]:
        """Step events then one Done; leaving early (a disconnect) cancels the generation."""
        try:
            while (event := await self._queue.get()) is not None:
                yield event
        finally:
            self.cancel.set()

    def _work(self) -> None:
        metrics, engine = self.served.metrics, self.served.engine
        done: Done | None = None
        ran = False
        metrics.queued_one()
        try:
            if self.served.streams is not None:
                ran = True
                metrics.started_one()
                done = self._stream(self.served.streams)
            elif self._wait_for(engine.lock):
                try:
                    metrics.started_one()
                    ran = True
                    done = self._generate(engine)
                finally:
                    engine.lock.release()
        except Exception as error:  # noqa: BLE001 - reported to the client as an error event
            done = Done(text="", token_ids=(), stop_reason="error", stats=RunStats(),
                        error=f"{type(error).__name__}: {error}")
            self._put(done)
        finally:
            self.ticket.close()
            metrics.finished(done, ran)
            if self.on_end is not None:
                self.on_end()
            self._put(None)

    def _wait_for(self, lock: threading.Lock) -> bool:
        """Take the engine's lock; False when cancelled first (a client that left the queue)."""
        while not lock.acquire(timeout=LOCK_POLL_S):
            if self.cancel.is_set():
                return False
        if self.cancel.is_set():
            lock.release()
            return False
        return True

    def _generate(self, engine: Any) -> Done | None:
        done = None
        events = compute.steps(engine.generate(self.job.prompt_ids, self.job.params,
                                               self.cancel, drafter=self.job.drafter,
                                               k=self.job.k, partition=self.job.partition))
        try:
            for event in events:
                self._put(event)
                done = event if isinstance(event, Done) else done
        finally:
            events.close()  # runs the engine's finally: the cache is rewound
        return done

    def _stream(self, streams: Any) -> Done | None:
        """The generation as one of the scheduler's streams (app/runtime/streams.py): it
        waits there for a slot, and its cancel event frees the slot."""
        from app.drafters.suffix import for_partition
        from app.runtime.streams import Request

        job = self.job
        request = streams.submit(Request(job.prompt_ids, job.params, job.drafter_name, job.k,
                                         job.partition, self.cancel, bind=for_partition))
        done = None
        for event in request.events():
            self._put(event)
            done = event if isinstance(event, Done) else done
        return done

    def _put(self, item: Step | Done | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()
