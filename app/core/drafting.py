"""Drafting as a coroutine: a drafter whose forwards a scheduler may batch across streams.

Knows: the Drafter protocol, ForwardCall and Forwarded (protocols.py). Must not know: array
libraries, schedulers, what a drafter computes with.

A drafter that has `propose_steps` yields each forward it needs (a ForwardCall on its own
session, naming its model) and is sent its Forwarded, as the engine's generation is; its
draft is the generator's return value. The batched streams scheduler then runs the draft
forwards of every stream as one, as it runs their verify forwards. Alone, `alone` runs each
forward on its session as it is asked. Other drafters keep `propose`.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Any, Protocol, runtime_checkable

from app.core.protocols import ForwardCall, Forwarded

Proposal = Generator[ForwardCall, Forwarded, Any]  # returns the Draft (or what is drafted)


@runtime_checkable
class ProposesInSteps(Protocol):
    def propose_steps(self, context: Sequence[int], k: int) -> Proposal: ...


def proposal(drafter: Any, context: Sequence[int], k: int) -> Proposal:
    """The drafter's draft of k tokens; its forwards yielded where it drafts in steps."""
    if isinstance(drafter, ProposesInSteps):
        return (yield from drafter.propose_steps(context, k))
    return drafter.propose(context, k)


def alone(steps: Proposal) -> Any:
    """Run a proposal's forwards one by one on their own sessions; its return value."""
    try:
        call = next(steps)
        while True:
            t0 = time.perf_counter()
            out = call.run()
            call = steps.send(Forwarded(out, time.perf_counter() - t0, len(call.token_ids)))
    except StopIteration as stop:
        return stop.value


def timed(steps: Proposal) -> Generator[ForwardCall, Forwarded, tuple[Any, float]]:
    """The proposal's value and its own seconds: its host work and its forwards' time, not
    the time it waited while other streams' forwards ran."""
    spent = 0.0
    t = time.perf_counter()
    try:
        call = next(steps)
        while True:
            spent += time.perf_counter() - t
            forwarded = yield call
            spent += forwarded.seconds
            t = time.perf_counter()
            call = steps.send(forwarded)
    except StopIteration as stop:
        spent += time.perf_counter() - t
        return stop.value, spent
