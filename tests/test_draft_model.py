"""DraftModelDrafter: its cache follows the context; unsure drafts are cut short; bf16 padding
and int8 drafters keep the output; a context that repeats itself is drafted by lookup."""

from __future__ import annotations

import numpy as np

from app.core.engine import SpecEngine
from app.core.types import SamplingParams
from app.drafters import build_drafter
from app.drafters.draft_model import DraftModelDrafter

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]


def test_a_confidence_floor_shortens_drafts_and_keeps_the_output(target, unrelated):
    params = SamplingParams(max_new_tokens=30)
    free = list(SpecEngine(target, DraftModelDrafter(target, unrelated), k=6)
                .generate(PROMPT, params))[-1]
    cautious = list(SpecEngine(target, DraftModelDrafter(target, unrelated, min_confidence=0.9),
                               k=6).generate(PROMPT, params))[-1]
    assert cautious.token_ids == free.token_ids
    assert cautious.stats.drafted < free.stats.drafted
    # one draft token at least per step, but for the last step, which the token limit leaves empty
    assert cautious.stats.drafted >= cautious.stats.target_forwards - 1


def test_drafter_cache_catches_up_after_full_acceptance(target):
    drafter = DraftModelDrafter(target, target)
    drafter.begin(PROMPT, None, SamplingParams(), np.random.default_rng(0))
    first = drafter.propose(PROMPT, 3)
    # every draft accepted, then a bonus token: the cache holds PROMPT + d1 + d2, not d3
    context = PROMPT + list(first.tokens) + [7]
    second = drafter.propose(context, 2)
    fresh = DraftModelDrafter(target, target)
    fresh.begin(context, None, SamplingParams(), np.random.default_rng(0))
    assert second.tokens == fresh.propose(context, 2).tokens
    assert drafter._session.length == len(context) + 1  # context plus the first new draft token


def test_padded_forwards_match_batched_rows_bit_for_bit_in_bf16():
    import torch

    from tests.tiny import tiny_llama

    model = tiny_llama(seed=1)
    model.hf.to(torch.bfloat16)
    model.min_rows = 4
    session = model.start()
    session.forward(PROMPT, n_logits=1)
    batched = session.forward([3, 4, 5, 6, 7], n_logits=5).host_logits()
    session.rewind(len(PROMPT))
    for n in (1, 2, 3):
        rows = session.forward([3, 4, 5, 6, 7][:n], n_logits=n).host_logits()
        assert session.length == len(PROMPT) + n, "padding rows never stay in the cache"
        assert (rows == batched[:n]).all()
        session.rewind(len(PROMPT))


def test_an_int8_drafter_keeps_the_output_and_still_agrees_often(tmp_path, target):
    from backends.torch.backend import TorchBackend
    from tests.tiny import save_hf_folder

    folder = save_hf_folder(target, tmp_path / "tiny")
    draft = TorchBackend().load(str(folder), device="cpu", dtype="int8")
    assert draft.dtype == "int8" and draft.weights_bytes() < target.weights_bytes() / 2
    params = SamplingParams(max_new_tokens=30)
    plain = list(SpecEngine(target).generate(PROMPT, params))[-1]
    done = list(SpecEngine(target, DraftModelDrafter(target, draft), k=4)
                .generate(PROMPT, params))[-1]
    assert done.token_ids == plain.token_ids
    assert done.stats.acceptance_rate > 0.5


def test_the_prompt_is_read_when_the_drafter_first_drafts_not_when_a_reply_begins(target):
    drafter = DraftModelDrafter(target, target)
    drafter.begin(PROMPT, None, SamplingParams(), np.random.default_rng(0))
    assert drafter._session.length == 0  # a reply that never drafts never pays for it
    assert drafter.unread_rows(PROMPT) == len(PROMPT) - 1  # the last row is read drafting
    first = drafter.propose(PROMPT, 2)
    assert first.catch_up_s > 0.0 and first.reads_prompt
    assert first.catch_up_rows == len(PROMPT) - 1
    assert drafter.unread_rows(PROMPT) == 0
    assert drafter.unread_rows(PROMPT + [3, 4]) == 0  # d_k and a bonus: drafting reads them
    assert drafter.unread_rows(PROMPT + [3, 4, 5, 6, 7, 8]) == 5
    again = drafter.propose(PROMPT, 2)
    assert again.catch_up_s == 0.0 and not again.reads_prompt
    later = drafter.propose(PROMPT + [3, 4, 5, 6, 7, 8], 2)  # missed tokens, not the prompt
    assert later.catch_up_s > 0.0 and not later.reads_prompt


def test_context_missed_while_speculation_was_off_is_read_as_catch_up(target):
    drafter = DraftModelDrafter(target, target)
    drafter.begin(PROMPT, None, SamplingParams(), np.random.default_rng(0))
    drafter.propose(PROMPT, 2)
    assert drafter.propose(PROMPT, 2).catch_up_s == 0.0
    later = PROMPT + [3, 4, 5, 6, 7, 8]  # six tokens decoded by steps that did not draft
    resumed = drafter.propose(later, 2)
    assert resumed.catch_up_s > 0.0
    fresh = DraftModelDrafter(target, target)
    fresh.begin(later, None, SamplingParams(), np.random.default_rng(0))
    assert resumed.tokens == fresh.propose(later, 2).tokens


def lookup_then(target, draft):
    from backends.torch.backend import TorchBackend
    return build_drafter("chain", target, backend=TorchBackend(), draft=draft)


def test_a_context_that_repeats_itself_is_drafted_by_lookup_without_a_draft_forward(target):
    chain = lookup_then(target, target)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    draft = chain.propose(context, 4)
    assert (draft.tokens, draft.source) == ((4, 5, 6, 7), "lookup")
    assert chain.members[1]._session.length == 0


def test_a_match_with_fewer_than_k_tokens_after_it_is_left_to_the_model(target):
    chain = lookup_then(target, target)
    draft = chain.propose([7, 1, 2, 3, 9, 1, 2, 3], 8)
    assert (len(draft.tokens), draft.source) == (8, "draft")
    assert chain.members[1]._session.length > 0


def test_with_history_a_short_request_continuation_is_still_left_to_the_model(target, tmp_path,
                                                                             monkeypatch):
    from app.store.history import History, HistoryStore
    from backends.torch.backend import TorchBackend

    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    chain = build_drafter("chain", target, backend=TorchBackend(), draft=target,
                          history=History(HistoryStore("tiny")))
    draft = chain.propose([7, 1, 2, 3, 9, 1, 2, 3], 8)
    assert (len(draft.tokens), draft.source) == (8, "draft")


def test_lookup_first_drafting_keeps_the_output_of_a_repetitive_prompt(target, unrelated):
    # lookups draft deterministic tokens (one-hot q); tests/test_verify.py checks such drafts
    # keep the sampled distribution
    prompt = [4, 8, 15, 16, 23, 42, 7, 4, 8, 15, 16, 23, 42, 7, 4, 8, 15]
    params = SamplingParams(max_new_tokens=40)
    plain = list(SpecEngine(target).generate(prompt, params))[-1]
    for drafter in (DraftModelDrafter(target, unrelated), lookup_then(target, unrelated)):
        done = list(SpecEngine(target, drafter, k=4).generate(prompt, params))[-1]
        assert done.token_ids == plain.token_ids
        assert done.stats.drafted > 0


def test_a_chain_reports_each_members_share_and_the_draft_model_its_own_acceptance(target):
    # the target as its own draft model: every model draft is accepted, whatever lookup did
    prompt = [4, 8, 15, 16, 23, 42, 7, 4, 8, 15, 16, 23, 42, 7, 4, 8, 15]
    done = list(SpecEngine(target, lookup_then(target, target), k=4).generate(
        prompt, SamplingParams(max_new_tokens=40)))[-1]
    members = {d.name: d for d in done.stats.drafters}
    assert members["draft"].drafted > 0 and members["draft"].acceptance_rate >= 0.99
    assert sum(d.drafted for d in members.values()) == done.stats.drafted
    assert sum(d.accepted for d in members.values()) == done.stats.accepted


def test_a_drafter_reads_only_the_end_of_a_long_prompt_keeps_it_for_the_next_turn_and_the_output(
        target, monkeypatch):
    from app.drafters import draft_model

    monkeypatch.setattr(draft_model, "DRAFT_CONTEXT", 8)
    prompt = [5, 9, 12, 5, 9, 3, 7, 5, 9, 11, 4, 6, 5, 9, 12, 2, 8, 5, 9, 3]
    params = SamplingParams(max_new_tokens=6)
    plain = list(SpecEngine(target).generate(prompt, params))[-1]
    drafter = DraftModelDrafter(target, target)
    engine = SpecEngine(target, drafter, k=3)
    done = list(engine.generate(prompt, params))[-1]
    assert done.token_ids == plain.token_ids and done.stats.accepted > 0
    assert drafter._session.length <= 8 + 6  # the window and the answer, not the prompt
    follow_up = [*prompt, *done.token_ids, 7, 3]
    start = drafter._start
    list(engine.generate(follow_up, params))
    assert drafter._start == start  # still under twice the window: the cache is reused


def test_a_new_prompt_is_read_from_its_last_window_whatever_the_last_prompt_was(
        target, monkeypatch):
    from app.drafters import draft_model

    monkeypatch.setattr(draft_model, "DRAFT_CONTEXT", 8)
    params = SamplingParams(max_new_tokens=4)
    drafter = DraftModelDrafter(target, target)
    engine = SpecEngine(target, drafter, k=3)
    first = [5, 9, 12, 5, 9, 3, 7, 5, 9, 11, 4, 6]  # 12 tokens: under twice the window
    list(engine.generate(first, params))
    assert drafter._start == len(first) - 8
    unrelated = [3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 32, 38]
    plain = list(SpecEngine(target).generate(unrelated, params))[-1]
    done = list(engine.generate(unrelated, params))[-1]
    assert done.token_ids == plain.token_ids
    assert drafter._start == len(unrelated) - 8  # not the last prompt's start, nor 0
