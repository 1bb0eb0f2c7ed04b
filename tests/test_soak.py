"""Soak (issue 16): 1,000 short greedy requests from 4 concurrent clients, about 10% of them
leaving early, against a real `specdeck serve` over the tiny saved model.

Claims: no server error (no 5xx, no `error` finish in /metrics, no traceback in the log) and
no unexpected client error; every completed output (token ids, text, finish reason) equals the
same request's solo run; the server's RSS after warm-up grows under 5% by the end; /health
answers 200 throughout and after. Marked `soak`: `-m "not soak"` leaves it out, `make soak`
runs it alone and shows its numbers. Waits are on events (clients done, the server's gauges
back to zero, its finished count reaching what was sent), with a generous cap only so that a
broken server fails instead of hanging; the early leaves are random points, never a deadline.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from app.serve import prometheus
from tests.serving import save_tiny_model, serve_process

pytestmark = pytest.mark.soak

REQUESTS = 1000
WARM_UP = 100  # requests before the RSS baseline: caches, allocator pools and imports settle
CLIENTS = 4
LEAVE_SHARE = 0.10
RSS_GROWTH_MAX = 0.05
CAP_S = 600  # only a broken server reaches this
SEED = int(os.environ.get("SPECDECK_SOAK_SEED", "16"))
PROMPTS = ("w5 w9 w12 w5 w9", "w20 w21 w22 w23", "w7 w7 w30 w41 w7 w7 w30",
           "w33 w2 w18 w44 w9 w10")
MAX_TOKENS = (8, 12, 16)


@dataclass(frozen=True)
class Ask:
    """What a request asks for; its greedy output depends on nothing else."""

    chat: bool
    prompt: str
    max_tokens: int

    @property
    def path(self) -> str:
        return "/chat/completions" if self.chat else "/completions"

    def body(self, stream: bool) -> dict:
        asked = ({"messages": [{"role": "user", "content": self.prompt}]} if self.chat
                 else {"prompt": self.prompt})
        return {**asked, "max_tokens": self.max_tokens, "temperature": 0, "stream": stream}


@dataclass(frozen=True)
class Output:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str


@dataclass(frozen=True)
class Planned:
    """One request of the soak: stream or not, and where (if at all) its client leaves."""

    ask: Ask
    stream: bool
    leave_after_chunks: int | None = None  # a stream closed after this many data chunks
    leave_after_s: float | None = None  # a whole reply given up after this long


@dataclass
class Tally:
    """What the clients saw; one lock, since four threads add to it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    completed: int = 0
    left: int = 0  # the client closed before the whole reply
    left_whole: int = 0  # of those, non-streamed: maybe before the server read the body
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    def add(self, attr: str, value: object = 1) -> None:
        with self.lock:
            if isinstance(getattr(self, attr), list):
                getattr(self, attr).append(value)
            else:
                setattr(self, attr, getattr(self, attr) + value)


def asks() -> list[Ask]:
    return [Ask(chat, prompt, n) for chat in (False, True) for prompt in PROMPTS
            for n in MAX_TOKENS]


def plan(rng: random.Random, count: int, whole_s: float) -> list[Planned]:
    """count requests over every ask, half streamed; LEAVE_SHARE of them leave at a random
    point (a stream after 0..max_tokens chunks, a whole reply within ~2 solo durations)."""
    every = asks()
    planned = []
    for _ in range(count):
        ask, stream = rng.choice(every), rng.random() < 0.5
        if rng.random() >= LEAVE_SHARE:
            planned.append(Planned(ask, stream))
        elif stream:
            planned.append(Planned(ask, stream, leave_after_chunks=rng.randint(0, ask.max_tokens)))
        else:
            planned.append(Planned(ask, stream, leave_after_s=rng.uniform(0.0, 2 * whole_s)))
    return planned


def whole(client: httpx.Client, base_url: str, ask: Ask,
          read_s: float | None = None) -> Output:
    timeout = httpx.Timeout(CAP_S, read=read_s) if read_s is not None else CAP_S
    response = client.post(base_url + ask.path, json=ask.body(stream=False), timeout=timeout)
    if response.status_code != 200:
        raise AssertionError(f"{ask}: HTTP {response.status_code}: {response.text[:300]}")
    choice = response.json()["choices"][0]
    text = choice["message"]["content"] if ask.chat else choice["text"]
    return Output(tuple(choice["token_ids"]), text, choice["finish_reason"])


def streamed(client: httpx.Client, base_url: str, ask: Ask,
             leave_after_chunks: int | None) -> Output | None:
    """The stream's output, or None when the client left before [DONE] (by plan)."""
    ids: list[int] = []
    text, finish, chunks = [], None, 0
    with client.stream("POST", base_url + ask.path, json=ask.body(stream=True),
                       timeout=CAP_S) as response:
        if response.status_code != 200:
            raise AssertionError(f"{ask}: HTTP {response.status_code}: "
                                 f"{response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            if leave_after_chunks is not None and chunks == leave_after_chunks:
                return None  # leaving the block closes the connection mid-stream
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            chunks += 1
            body = json.loads(data)
            if "error" in body:
                raise AssertionError(f"{ask}: error event {body['error']}")
            choice = body["choices"][0]
            ids.extend(choice["token_ids"])
            text.append(choice["delta"].get("content", "") if ask.chat else choice["text"])
            finish = choice["finish_reason"] or finish
    if finish is None:
        raise AssertionError(f"{ask}: the stream ended without a finish reason")
    return Output(tuple(ids), "".join(text), finish)


def run_one(client: httpx.Client, base_url: str, planned: Planned,
            solo: dict[Ask, Output], tally: Tally) -> None:
    try:
        if planned.stream:
            output = streamed(client, base_url, planned.ask, planned.leave_after_chunks)
        else:
            output = whole(client, base_url, planned.ask, planned.leave_after_s)
    except httpx.ReadTimeout:
        if planned.leave_after_s is None:
            tally.add("errors", f"{planned}: timed out after {CAP_S} s")
        else:
            tally.add("left")
            tally.add("left_whole")
        return
    except Exception as error:  # noqa: BLE001 - every failure is counted and reported
        tally.add("errors", f"{planned}: {type(error).__name__}: {error}")
        return
    if output is None:
        tally.add("left")
        return
    tally.add("completed")
    if output != solo[planned.ask]:
        tally.add("mismatches", f"{planned.ask} stream={planned.stream}: {output} != solo "
                                f"{solo[planned.ask]}")


def soak(base_url: str, planned: list[Planned], solo: dict[Ask, Output], tally: Tally) -> None:
    """CLIENTS threads, each with its own connection pool, draining one shared list."""
    lock = threading.Lock()
    queue = list(reversed(planned))

    def client_loop() -> None:
        with httpx.Client() as client:
            while True:
                with lock:
                    if not queue:
                        return
                    item = queue.pop()
                run_one(client, base_url, item, solo, tally)

    threads = [threading.Thread(target=client_loop, name=f"soak-client-{i}")
               for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CAP_S)
        assert not thread.is_alive(), "a soak client never finished"


class HealthWatch:
    """Polls /health from its own thread while the soak runs; every answer must be 200."""

    def __init__(self, base_url: str) -> None:
        self.url = base_url.removesuffix("/v1") + "/health"
        self.answers: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="soak-health")

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        with httpx.Client() as client:
            while not self._stop.wait(0.5):
                try:
                    self.answers[str(client.get(self.url, timeout=CAP_S).status_code)] += 1
                except httpx.HTTPError as error:
                    self.answers[type(error).__name__] += 1


def metrics(base_url: str) -> list[prometheus.Sample]:
    return prometheus.parse(httpx.get(base_url.removesuffix("/v1") + "/metrics",
                                      timeout=CAP_S).text)


def finished(base_url: str) -> dict[str, float]:
    return prometheus.by_label(metrics(base_url), "specdeck:request_success_total",
                               "finished_reason")


def idle(base_url: str, sent: int, tally: Tally) -> bool:
    """Nothing runs or waits, and every request sent has finished on the server, but for
    whole replies left so early that the server never read their body (never started)."""
    samples = metrics(base_url)
    busy = sum(prometheus.total(samples, f"specdeck:num_requests_{g}") or 0.0
               for g in ("running", "waiting"))
    done = sum(prometheus.by_label(samples, "specdeck:request_success_total",
                                   "finished_reason").values())
    return busy == 0 and sent - tally.left_whole <= done <= sent


def wait_until(condition: Callable[[], bool], what: str,
               detail: Callable[[], object] = lambda: "") -> None:
    deadline = time.monotonic() + CAP_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what} {detail()}")
        time.sleep(0.1)


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def test_a_thousand_requests_with_random_disconnects_leave_the_server_correct_and_flat(
        tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "tiny")
    log = tmp_path / "serve.log"
    args = ["--target", str(model), "--drafter", "ngram", "--k", "4"]
    with serve_process(args, log) as (process, base_url):
        solo, whole_s = solo_runs(base_url)
        # replies handed to the wrong client would show: the prompts' outputs differ
        assert len({solo[ask] for ask in asks()}) >= 2 * len(PROMPTS), solo
        rng = random.Random(SEED)
        planned = plan(rng, REQUESTS, whole_s)
        sent = len(solo)
        tally = Tally()
        started = time.monotonic()
        with HealthWatch(base_url) as health:
            soak(base_url, planned[:WARM_UP], solo, tally)
            assert not tally.errors, tally.errors[:10]  # else the server's count never matches
            sent += WARM_UP
            wait_until(lambda: idle(base_url, sent, tally), "the warm-up finished on the server",
                       lambda: (sent, tally.left_whole, finished(base_url)))
            warm_rss = rss_mb(process.pid)
            soak(base_url, planned[WARM_UP:], solo, tally)
            assert not tally.errors, tally.errors[:10]
            sent += REQUESTS - WARM_UP
            wait_until(lambda: idle(base_url, sent, tally), "the soak finished on the server",
                       lambda: (sent, tally.left_whole, finished(base_url)))
            end_rss = rss_mb(process.pid)
        wall_s = time.monotonic() - started
        after = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=CAP_S)
        with httpx.Client() as client:
            again = whole(client, base_url, asks()[0])
        reasons = finished(base_url)
    growth = (end_rss - warm_rss) / warm_rss
    planned_leaves = sum(p.leave_after_chunks is not None or p.leave_after_s is not None
                         for p in planned)
    report = (f"soak: {REQUESTS} requests, {CLIENTS} clients, seed {SEED}: {wall_s:.1f} s, "
              f"{REQUESTS / wall_s:.1f} req/s; completed {tally.completed}, left {tally.left} "
              f"(planned {planned_leaves}), errors {len(tally.errors)}, mismatches "
              f"{len(tally.mismatches)}; server finishes {dict(reasons)}; RSS warm "
              f"{warm_rss:.1f} MB -> end {end_rss:.1f} MB ({100 * growth:+.2f}%); "
              f"/health {dict(health.answers)}")
    print(report)
    assert not tally.errors, tally.errors[:10]
    assert not tally.mismatches, tally.mismatches[:10]
    assert tally.completed + tally.left == REQUESTS
    assert tally.left > 0, "no client left early: the disconnect paths went untested"
    assert reasons.get("error", 0) == 0, report
    server_log = log.read_text()
    assert "Traceback" not in server_log and "ERROR" not in server_log, server_log[-3000:]
    assert set(health.answers) == {"200"}, health.answers
    assert after.status_code == 200 and again == solo[asks()[0]]
    assert growth < RSS_GROWTH_MAX, report


def solo_runs(base_url: str) -> tuple[dict[Ask, Output], float]:
    """Each ask alone, one at a time: the outputs the soak must reproduce, and the median
    duration of one whole reply (early leaves are drawn around it)."""
    solo: dict[Ask, Output] = {}
    durations = []
    with httpx.Client() as client:
        for ask in asks():
            start = time.monotonic()
            solo[ask] = whole(client, base_url, ask)
            durations.append(time.monotonic() - start)
    return solo, statistics.median(durations)
