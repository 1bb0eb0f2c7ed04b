"""The engine is lossless: speculative greedy output equals a naive no-cache greedy oracle.

Every test runs on each backend (torch, mlx) with the same tiny random fp32 weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from app.core.engine import SpecEngine
from app.core.types import Done, Draft, SamplingParams, Step
from app.drafters.ngram import NgramDrafter
from backends import load_backend

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]
KS = [1, 2, 4, 7]
BACKENDS = ["torch", "mlx"]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    if request.param == "mlx":
        pytest.importorskip("mlx_lm")
    return request.param


@pytest.fixture(scope="module")
def target(target, backend, request):
    """conftest's torch target, or its MLX twin (same weights)."""
    return target if backend == "torch" else request.getfixturevalue("mlx_target")


@pytest.fixture(scope="module")
def unrelated(unrelated, backend, request):
    return unrelated if backend == "torch" else request.getfixturevalue("mlx_unrelated")


@pytest.fixture(scope="module")
def draft_drafter(backend):
    """The backend's DraftModelDrafter factory: draft_drafter(target, draft)."""
    made = load_backend(backend)
    return lambda target, draft: made.make_drafter("draft", target, draft=draft)


def oracle(model, prompt: Sequence[int], n: int, eos: frozenset[int] = frozenset()) -> list[int]:
    """Naive greedy: the full sequence through a fresh session at every step, no cache reuse."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        token = model.start().forward(ids, n_logits=1).argmax[-1]
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out


def run(engine: SpecEngine, prompt: Sequence[int], **params) -> Done:
    events = list(engine.generate(prompt, SamplingParams(**params)))
    done = events[-1]
    assert isinstance(done, Done), done
    assert done.error is None, done.error
    assert all(isinstance(e, Step) for e in events[:-1])
    return done


class ScriptedDrafter:
    """Replays a known continuation with chosen draft positions corrupted."""

    capture_layers: tuple[int, ...] = ()
    name = "scripted"

    def __init__(self, sequence: Sequence[int], corrupt_every: int, vocab: int) -> None:
        self.sequence, self.every, self.vocab = list(sequence), corrupt_every, vocab

    def begin(self, prompt_ids, feed, params, rng) -> None:
        return None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        start = len(context)
        tokens = self.sequence[start:start + k]
        return Draft(tokens=tuple((t + 1) % self.vocab if (start + i) % self.every == 0 else t
                                  for i, t in enumerate(tokens)))

    def accept(self, feed) -> None:
        return None


@pytest.mark.parametrize("k", KS)
def test_target_as_its_own_drafter_accepts_every_token(target, k, draft_drafter):
    expected = oracle(target, PROMPT, 24)
    done = run(SpecEngine(target, draft_drafter(target, target), k=k), PROMPT,
               max_new_tokens=24)
    assert list(done.token_ids) == expected
    assert done.stats.accepted == done.stats.drafted > 0
    assert done.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("k", KS)
def test_unrelated_draft_model_keeps_the_oracle_output(target, unrelated, k, draft_drafter):
    expected = oracle(target, PROMPT, 24)
    done = run(SpecEngine(target, draft_drafter(target, unrelated), k=k), PROMPT,
               max_new_tokens=24)
    assert list(done.token_ids) == expected
    assert done.stats.drafted > 0


@pytest.mark.parametrize("k", KS)
def test_ngram_drafter_keeps_the_oracle_output(target, k):
    expected = oracle(target, PROMPT, 30)
    done = run(SpecEngine(target, NgramDrafter(), k=k), PROMPT, max_new_tokens=30)
    assert list(done.token_ids) == expected


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("every", [2, 3, 5])
def test_scripted_drafter_with_corrupted_positions_accepts_exactly_the_true_prefix(
        target, k, every):
    expected = oracle(target, PROMPT, 24)
    drafter = ScriptedDrafter(PROMPT + expected, every, target.vocab_size)
    done = run(SpecEngine(target, drafter, k=k), PROMPT, max_new_tokens=24)
    assert list(done.token_ids) == expected
    # a draft token survives iff it was not corrupted and every earlier one survived
    assert done.stats.accepted == expected_accepted(len(PROMPT), 24, k, every)
    assert sum(done.from_draft) == done.stats.accepted


def expected_accepted(n_prompt: int, limit: int, k: int, every: int) -> int:
    """Replay the step rule by hand: accept the drafts before the first corrupted position."""
    position, produced, accepted = n_prompt + 1, 1, 0
    while produced < limit:
        width = min(k, limit - produced - 1)
        m = next((i for i in range(width) if (position + i) % every == 0), width)
        accepted += m
        position += m + 1
        produced += m + 1
    return accepted


@pytest.mark.parametrize("k", KS)
def test_eos_inside_a_draft_truncates_exactly_there(target, k):
    free = oracle(target, PROMPT, 24)
    eos_token = free[6]
    expected = free[:free.index(eos_token) + 1]
    drafter = ScriptedDrafter(PROMPT + free, corrupt_every=1000, vocab=target.vocab_size)
    original = target.eos_token_ids
    target.eos_token_ids = frozenset({eos_token})
    try:
        done = run(SpecEngine(target, drafter, k=k), PROMPT, max_new_tokens=24)
    finally:
        target.eos_token_ids = original
    assert list(done.token_ids) == expected
    assert done.stop_reason == "eos"


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("limit", [1, 2, 5, 11])
def test_token_limit_inside_a_draft_truncates_exactly_there(target, k, limit):
    free = oracle(target, PROMPT, 24)
    drafter = ScriptedDrafter(PROMPT + free, corrupt_every=1000, vocab=target.vocab_size)
    done = run(SpecEngine(target, drafter, k=k), PROMPT, max_new_tokens=limit)
    assert list(done.token_ids) == free[:limit]
    assert done.stop_reason == "length"
    assert done.stats.n_new_tokens == limit


def test_plain_decoding_is_one_token_per_forward(target):
    done = run(SpecEngine(target), PROMPT, max_new_tokens=12)
    assert list(done.token_ids) == oracle(target, PROMPT, 12)
    assert done.stats.mean_accepted_length == 1.0
    assert done.stats.target_forwards == 11


def test_cache_holds_committed_tokens_minus_the_pending_one(target, unrelated, draft_drafter):
    engine = SpecEngine(target, draft_drafter(target, unrelated), k=4)
    done = run(engine, PROMPT, max_new_tokens=13)
    assert engine.session.length == len(PROMPT) + len(done.token_ids) - 1


def test_second_turn_reuses_the_cached_prefix_and_stays_exact(target):
    engine = SpecEngine(target, NgramDrafter(), k=3)
    first = run(engine, PROMPT, max_new_tokens=8)
    follow = PROMPT + list(first.token_ids) + [4, 6]
    second = run(engine, follow, max_new_tokens=10)
    assert second.stats.n_cached_prompt_tokens == len(PROMPT) + len(first.token_ids) - 1
    assert list(second.token_ids) == oracle(target, follow, 10)


def test_stopping_midway_leaves_the_engine_consistent(target):
    engine = SpecEngine(target, NgramDrafter(), k=4)
    stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=30))
    next(stream), next(stream)
    stream.close()  # a consumer walking away, as a closed browser tab does
    done = run(engine, PROMPT, max_new_tokens=15)
    assert list(done.token_ids) == oracle(target, PROMPT, 15)


def test_an_exception_in_a_step_becomes_an_error_event_and_the_next_run_works(target):
    class Exploding(ScriptedDrafter):
        def propose(self, context, k):
            raise RuntimeError("boom")

    engine = SpecEngine(target, Exploding([], 2, target.vocab_size), k=2)
    done = list(engine.generate(PROMPT, SamplingParams(max_new_tokens=10)))[-1]
    assert done.stop_reason == "error" and "boom" in done.error
    assert engine.session.length <= len(PROMPT)
    engine.drafter = NgramDrafter()
    assert list(run(engine, PROMPT, max_new_tokens=10).token_ids) == oracle(target, PROMPT, 10)


def test_cancel_event_stops_with_reason_cancelled(target):
    import threading
    cancel = threading.Event()
    engine = SpecEngine(target, NgramDrafter(), k=2)
    events = []
    for event in engine.generate(PROMPT, SamplingParams(max_new_tokens=50), cancel=cancel):
        events.append(event)
        cancel.set()
    assert events[-1].stop_reason == "cancelled"
    assert engine.session.length == len(PROMPT) + len(events[-1].token_ids) - 1


def test_sampled_generation_is_reproducible_with_a_seed(target, unrelated, draft_drafter):
    params = dict(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16)
    a = run(SpecEngine(target, draft_drafter(target, unrelated), k=3), PROMPT, **params)
    b = run(SpecEngine(target, draft_drafter(target, unrelated), k=3), PROMPT, **params)
    assert a.token_ids == b.token_ids


def test_rewind_round_trip_gives_the_same_logits(target):
    session = target.start()
    session.forward(PROMPT, n_logits=1)
    first = session.forward([3, 4, 5], n_logits=3).host_logits()
    session.rewind(len(PROMPT))
    again = session.forward([3, 4, 5], n_logits=3).host_logits()
    np.testing.assert_allclose(first, again, rtol=0, atol=1e-6)
    assert session.length == len(PROMPT) + 3


def test_one_engine_serves_every_drafter_per_call_and_reuses_the_shared_prefix(target):
    from app.drafters import build_drafter
    from backends.torch.backend import TorchBackend

    backend = TorchBackend()
    engine = SpecEngine(target)
    prompt = [5, 9, 12, 5, 9, 3, 7, 5, 9]
    params = SamplingParams(max_new_tokens=24)
    plain = list(SpecEngine(target).generate(prompt, params))[-1]
    kinds = ["chain", "none", "ngram", "draft", "ngram-tree", "chain"]
    for i, kind in enumerate(kinds):
        drafter = build_drafter(kind, target, backend=backend, draft=target)
        done = list(engine.generate(prompt, params, drafter=drafter, k=4))[-1]
        assert done.token_ids == plain.token_ids, kind
        # after the first call only the pending last prompt token is read again
        assert done.stats.n_cached_prompt_tokens == (0 if i == 0 else len(prompt) - 1), kind
