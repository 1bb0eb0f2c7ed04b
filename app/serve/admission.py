"""What the server checks before it reads, parses or queues a request body.

Knows: the Content-Type a POST must carry (application/json, so that a cross-site "simple
request" from a web page, which cannot send it without a CORS preflight, never starts work),
the body-size limit (413), how many requests may wait for the engine (429 with Retry-After)
and which requests are live, so that shutdown can cancel them all. Must not know: engines,
OpenAI fields or FastAPI (a body arrives as an async iterator of byte chunks).
"""

import math
import threading
import time
from collections.abc import AsyncIterable

from app.serve.requests import ApiError

JSON_TYPE = "application/json"
RECENT_WEIGHT = 0.3  # how much the latest request's duration moves the Retry-After estimate


def require_json(content_type: str | None) -> None:
    """415 unless the body is declared as JSON (any charset parameter is fine)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != JSON_TYPE:
        raise ApiError(f"send the body as JSON with 'Content-Type: {JSON_TYPE}' (got "
                       f"{media or 'none'!r})", status=415, code="unsupported_media_type")


async def read_body(declared_length: str | None, chunks: AsyncIterable[bytes],
                    limit: int) -> bytes:
    """The whole body, or 413 as soon as it (declared or as received) exceeds limit bytes."""
    if declared_length and declared_length.isdigit() and int(declared_length) > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(limit: int) -> ApiError:
    return ApiError(f"the request body is larger than {limit / 2**20:g} MiB: send less, or "
                    "restart the server with a larger --max-body-mb", status=413,
                    code="request_too_large")


class Ticket:
    """One admitted request, live until closed; closing twice is harmless."""

    def __init__(self, gate: "Gate") -> None:
        self._gate = gate
        self._events: list[threading.Event] = []
        self._opened = time.monotonic()
        self._closed = False

    def watch(self, cancel: threading.Event) -> None:
        """Set cancel when the server stops (now, if it already is stopping)."""
        self._events.append(cancel)
        if self._gate.stopping:
            cancel.set()

    def close(self) -> None:
        self._gate._release(self)

    def cancel(self) -> None:
        for event in self._events:
            event.set()


class Gate:
    """Admission: one request generates while at most max_waiting others wait or prepare."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.stopping = False
        self._lock = threading.Lock()
        self._live: set[Ticket] = set()
        self._mean_s = 1.0  # seconds a request stays live, a running estimate

    def admit(self) -> Ticket:
        """A ticket for one more request; 429 (with Retry-After) when the queue is full."""
        with self._lock:
            if self.stopping:
                raise ApiError("the server is shutting down", status=503,
                               kind="server_error", code="shutting_down")
            if len(self._live) > self.max_waiting:
                raise ApiError(f"{len(self._live)} requests are already running or waiting "
                               f"(--max-waiting {self.max_waiting}): retry later", status=429,
                               kind="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(self._retry_after())})
            ticket = Ticket(self)
            self._live.add(ticket)
            return ticket

    def stop(self) -> None:
        """Refuse new requests and cancel every live one (server shutdown)."""
        with self._lock:
            self.stopping = True
            live = list(self._live)
        for ticket in live:
            ticket.cancel()

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._live)

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket._closed:
                return
            ticket._closed = True
            self._live.discard(ticket)
            spent = time.monotonic() - ticket._opened
            self._mean_s += RECENT_WEIGHT * (spent - self._mean_s)

    def _retry_after(self) -> int:
        # the queue ahead drains one request at a time
        return max(1, math.ceil(self._mean_s * len(self._live)))
