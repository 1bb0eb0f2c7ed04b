"""Model work runs on one thread per process, whichever thread asks (app/runtime/compute.py).

OpenMP keeps a team of threads per calling thread; two teams on two cores slowed every
forward of the 1.5B by a third for the rest of the process. These claims hold the one-thread
rule where serve and the UI generate, and the rule's own contract (errors, nesting, closing).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest

from app.core.engine import SpecEngine
from app.drafters.ngram import NgramDrafter
from app.runtime import compute
from app.serve.jobs import Served
from app.serve.routes import build_app
from tests.serving import CHAT_TEMPLATE
from tests.tiny import tiny_llama


def counting(n: int, seen: list[str], closed: list[str]) -> Iterator[int]:
    try:
        for i in range(n):
            seen.append(threading.current_thread().name)
            yield i
    finally:
        closed.append(threading.current_thread().name)


def test_every_step_of_an_iterator_runs_on_the_compute_thread() -> None:
    seen: list[str] = []
    closed: list[str] = []
    assert list(compute.steps(counting(5, seen, closed))) == [0, 1, 2, 3, 4]
    assert seen == [compute.THREAD_NAME] * 5
    assert closed == [compute.THREAD_NAME]


def test_closing_the_steps_early_closes_the_iterator_on_the_compute_thread() -> None:
    seen: list[str] = []
    closed: list[str] = []
    steps = compute.steps(counting(10, seen, closed))
    assert next(steps) == 0
    steps.close()
    assert closed == [compute.THREAD_NAME]
    assert len(seen) == 1


def test_two_interleaved_step_streams_keep_the_callers_order() -> None:
    order: list[str] = []

    def lane(name: str) -> Iterator[str]:
        for i in range(3):
            order.append(f"{name}{i}")
            yield name

    a, b = compute.steps(lane("a")), compute.steps(lane("b"))
    for _ in range(3):
        next(a)
        next(b)
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_job_that_calls_another_runs_it_at_once_instead_of_waiting_on_itself() -> None:
    def outer() -> str:
        return compute.call(lambda: threading.current_thread().name)

    assert compute.call(outer) == compute.THREAD_NAME


def test_an_error_in_a_job_is_raised_in_the_caller_and_the_thread_goes_on() -> None:
    def fails() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        compute.call(fails)
    assert compute.call(lambda: 7) == 7


def test_jobs_from_many_threads_all_run_on_the_one_compute_thread() -> None:
    names: list[str] = []
    threads = [threading.Thread(target=lambda: names.append(compute.call(
        lambda: threading.current_thread().name))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert names == [compute.THREAD_NAME] * 4


def test_a_served_generation_forwards_the_target_on_the_compute_thread_only() -> None:
    model = tiny_llama(seed=1)
    model.tokenizer.chat_template = CHAT_TEMPLATE
    forwarded: list[str] = []
    start = model.start

    def spying_start(*args, **kwargs):
        session = start(*args, **kwargs)
        forward = session.forward

        def spy(*f_args, **f_kwargs):
            forwarded.append(threading.current_thread().name)
            return forward(*f_args, **f_kwargs)

        session.forward = spy
        return session

    model.start = spying_start
    served = Served(engine=SpecEngine(model, NgramDrafter(), k=4), model_id="tiny",
                    drafter_name="ngram")

    async def two_requests() -> list[int]:
        transport = httpx.ASGITransport(app=build_app(served))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"messages": [{"role": "user", "content": "w5 w9 w12 w5 w9"}],
                    "max_tokens": 12, "temperature": 0}
            replies = [await client.post("/v1/chat/completions", json=body) for _ in range(2)]
            return [r.status_code for r in replies]

    assert asyncio.run(two_requests()) == [200, 200]
    assert forwarded and set(forwarded) == {compute.THREAD_NAME}
