"""Batched streams (app/runtime/streams.py): every live generation of one target steps
together, each stream's rows in one forward, and no stream's tokens change for it: greedy
and seeded streams under load give their solo tokens, on a target whose rows are exact
(bf16 on the lean forward, padded and cut into the load-time check's blocks)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from app.core.engine import SpecEngine, last_done  # noqa: E402
from app.core.types import Done, SamplingParams, Step  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from app.runtime.streams import Request, Streams, capacity, fork_engines  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from tests.tiny import save_hf_folder, tiny_llama  # noqa: E402

PROMPTS = ([5, 9, 12, 5, 9, 12, 5, 9], [7, 8, 7, 8, 7, 8, 7], [20, 21, 22, 23, 20, 21, 22],
           [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 30, 31])
# (drafter kind, k) per stream: plain, lookup at a fixed k and at auto, a draft model
KINDS = (("none", 0), ("ngram", 4), ("ngram", "auto"), ("draft", 3))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    backend = TorchBackend()
    loaded = []
    for seed in (1, 2):
        folder = save_hf_folder(tiny_llama(seed=seed), tmp_path_factory.mktemp(f"m{seed}"))
        model = backend.load(str(folder), device="cpu", dtype="bfloat16")
        model.eos_token_ids = frozenset()  # every reply runs its whole length
        loaded.append(model)
    return backend, *loaded


def _build(models):
    backend, target, draft = models
    return lambda kind: build_drafter(kind, target, backend=backend, draft=draft)


def _scheduler(models, slots: int, **kwargs) -> Streams:
    engine = SpecEngine(models[1])
    return Streams(fork_engines(engine, slots), _build(models), **kwargs)


def _solo(models, prompt, kind, k, params) -> Done:
    engine = SpecEngine(models[1])
    drafter = None if kind == "none" else _build(models)(kind)
    return last_done(engine.generate(prompt, params, drafter=drafter, k=k))


def _request(prompt, kind, k, params) -> Request:
    return Request(list(prompt), params, kind, k, "local", threading.Event())


def _done(request: Request) -> Done:
    return [e for e in request.events() if isinstance(e, Done)][-1]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_new_tokens=24),
                                    SamplingParams(temperature=1.0, seed=7, max_new_tokens=24)],
                         ids=["greedy", "seeded"])
def test_every_stream_under_load_gives_its_solo_tokens_plain_and_speculative(models, params):
    streams = _scheduler(models, slots=4)
    cases = [(p, kind, k) for p, (kind, k) in zip(PROMPTS, KINDS)
             if params.greedy or k != "auto"]  # auto's k follows the load, so its draws do
    requests = [streams.submit(_request(p, kind, k, params)) for p, kind, k in cases]
    dones = [_done(r) for r in requests]
    for (prompt, kind, k), done in zip(cases, dones):
        assert done.stop_reason == "length", done.error
        assert done.token_ids == _solo(models, prompt, kind, k, params).token_ids, kind
    assert streams.batched_rows > streams.batches  # forwards held several streams' rows
    assert sum(d.stats.drafted for d in dones) > 0


def test_greedy_streams_draft_together_and_sampled_ones_draft_alone(models):
    """A greedy stream's draft forwards join one forward of the draft model (the target's
    verify decides every token); a sampled stream's run alone (its q feeds seeded draws)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    streams = _scheduler(models, slots=3)
    requests = [streams.submit(_request(p, "draft", 3, greedy)) for p in PROMPTS[:3]]
    for prompt, request in zip(PROMPTS, requests):
        assert _done(request).token_ids == _solo(models, prompt, "draft", 3, greedy).token_ids
    assert streams.draft_rows > streams.draft_batches > 0
    seeded = SamplingParams(temperature=1.0, seed=3, max_new_tokens=8)
    streams = _scheduler(models, slots=2)
    for request in [streams.submit(_request(p, "draft", 3, seeded)) for p in PROMPTS[:2]]:
        assert _done(request).stop_reason == "length"
    assert streams.draft_batches == 0


def test_a_long_prompt_fed_in_pieces_beside_a_decoding_stream_changes_neither(models):
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    long_prompt = [(3 * i) % 40 + 2 for i in range(45)]
    streams = _scheduler(models, slots=2, prefill_chunk=4)
    first = streams.submit(_request(PROMPTS[0], "ngram", 3, params))
    second = streams.submit(_request(long_prompt, "none", 0, params))
    assert _done(first).token_ids == _solo(models, PROMPTS[0], "ngram", 3, params).token_ids
    assert _done(second).token_ids == _solo(models, long_prompt, "none", 0, params).token_ids


def test_a_request_beyond_the_slots_waits_and_runs_when_one_frees(models):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    streams = _scheduler(models, slots=1)
    requests = [streams.submit(_request(p, "none", 0, params)) for p in PROMPTS[:3]]
    for prompt, request in zip(PROMPTS, requests):
        assert _done(request).token_ids == _solo(models, prompt, "none", 0, params).token_ids
    assert streams.live == 0 and streams.waiting == 0


def test_a_cancelled_stream_frees_its_slot_for_the_next_request(models):
    params = SamplingParams(temperature=0.0, max_new_tokens=200)
    streams = _scheduler(models, slots=1)
    first = streams.submit(_request(PROMPTS[0], "none", 0, params))
    events = first.events()
    assert isinstance(next(events), Step)
    first.cancel.set()
    assert [e for e in events if isinstance(e, Done)][-1].stop_reason == "cancelled"
    second = streams.submit(_request(PROMPTS[1], "none", 0, params.__class__(
        temperature=0.0, max_new_tokens=4)))
    assert _done(second).stop_reason == "length"


def test_a_request_cancelled_while_it_waits_ends_without_running(models):
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    streams = _scheduler(models, slots=1)
    running = streams.submit(_request(PROMPTS[0], "none", 0, params))
    queued = _request(PROMPTS[1], "none", 0, params)
    queued.cancel.set()
    streams.submit(queued)
    assert list(queued.events()) == []
    assert _done(running).stop_reason == "length"


def test_a_prompt_goes_to_the_slot_whose_cache_holds_its_prefix(models):
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    streams = _scheduler(models, slots=2)
    for prompt in PROMPTS[:2]:
        _done(streams.submit(_request(prompt, "none", 0, params)))
    again = streams.submit(_request(PROMPTS[1] + [9, 9], "none", 0, params))
    assert _done(again).stats.n_cached_prompt_tokens >= len(PROMPTS[1])


def test_memory_caps_the_slots_and_says_so():
    assert capacity(4, per_stream_bytes=100, free_bytes=250, context=4096).slots == 2
    assert "memory holds 2" in capacity(4, 100, 250, 4096).reason
    assert capacity(4, 100, 10_000, 4096).reason == "--parallel 4"
    assert capacity(4, 100, 10, 4096).slots == 1  # one stream always runs (the load checked)


def test_capacity_counts_streams_with_the_draft_models_kv_and_without():
    fit = capacity(4, per_stream_bytes=150, free_bytes=3_000, context=4096,
                   plain_stream_bytes=100)
    assert (fit.slots, fit.fit_speculating, fit.fit_plain) == (4, 20, 30)
    assert fit.summary().endswith("memory holds 20 with speculation, 30 without")
