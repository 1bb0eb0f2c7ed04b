"""Torch sessions: the backend builds one per cache strategy; an ended session leaves nothing
behind on the model it shared (no hook, nothing that keeps it alive); a drafter's vocabulary
subset and 4-bit head are its session's own, never a change to the shared model."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from app.core.engine import SpecEngine
from app.core.types import SamplingParams
from app.drafters.draft_model import DraftModelDrafter
from backends.torch import w4a8
from backends.torch.backend import TorchBackend
from backends.torch.quantized_linear import W8A8Linear
from backends.torch.session import HfSession, LeanSession
from tests.conftest import W4A8, save_hf_folder, tiny_llama

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]
OTHER = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
PARENTS = (-1, 0, 0, 1, 2)


@pytest.fixture(scope="module")
def hf_model():
    """A model the lean forward does not compute (unfused projections): HF's DynamicCache."""
    return tiny_llama(seed=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_hf_folder(tiny_llama(seed=1), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def lean_model(folder):
    return TorchBackend().load(str(folder), device="cpu", dtype="float32")


def _hooks(model) -> list:
    return [hook for module in model.hf.modules()
            for hook in (*module._forward_hooks.values(), *module._forward_pre_hooks.values())]


def _ended_session(model) -> weakref.ref:
    session = model.start(capture_layers=(0,))
    session.forward(PROMPT, n_logits=1, capture=(1,))
    session.forward([3, 4, 5, 6, 7], n_logits=5, parents=PARENTS, capture=(0, 1))
    session.keep(len(PROMPT), (0, 2, 4))
    return weakref.ref(session)


def test_the_backend_builds_a_lean_session_where_the_lean_forward_computes_the_model(
        lean_model, hf_model):
    assert isinstance(lean_model.start(), LeanSession)
    assert isinstance(hf_model.start(), HfSession)


def test_an_ended_session_on_the_dynamic_cache_is_freed_once_nothing_holds_it(hf_model):
    ended = [_ended_session(hf_model) for _ in range(3)]
    gc.collect()
    assert [ref() for ref in ended] == [None, None, None]


def test_a_later_forward_of_the_model_runs_no_hook_of_an_earlier_session(hf_model):
    _ended_session(hf_model)
    live = hf_model.start(capture_layers=(0, 1))
    live.forward(PROMPT, n_logits=1)
    assert _hooks(hf_model) == []  # nothing for a plain forward to call


def test_a_forward_that_raises_leaves_no_hook_on_the_model(hf_model):
    session = hf_model.start(capture_layers=(0, 1))
    with pytest.raises(IndexError):
        session.forward([hf_model.vocab_size + 5], n_logits=1)  # no such embedding row
    assert _hooks(hf_model) == []


def test_another_threads_forward_during_a_capture_leaves_the_captured_states_alone(hf_model):
    expected = hf_model.start().forward(PROMPT, n_logits=1, capture=(1,)).hidden_states[1]
    other = hf_model.start()
    fired = []

    def interleave(_module, _inputs, _output):
        # another session's forward runs the shared layers before and after this one's layer 1
        if threading.current_thread() is threading.main_thread():
            fired.append(1)
            worker = threading.Thread(target=other.forward, args=(OTHER[:len(fired)],))
            worker.start()
            worker.join()

    handles = [hf_model.layers[0].register_forward_hook(interleave),
               hf_model.hf.model.norm.register_forward_hook(interleave)]
    try:
        got = hf_model.start().forward(PROMPT, n_logits=1, capture=(1,)).hidden_states[1]
    finally:
        for handle in handles:
            handle.remove()
    assert len(fired) == 2 and other.length == 3
    assert torch.equal(got, expected)


def _model_state(model) -> tuple:
    head = model.hf.get_output_embeddings()
    tensors = [t.clone() for t in (*head.parameters(), *head.buffers())]
    return head, type(head), tensors, model.hf.config.to_dict(), model.vocab_size


def _assert_unchanged(model, before, logits) -> None:
    head, kind, tensors, config, vocab = before
    now = model.hf.get_output_embeddings()
    assert now is head and type(now) is kind and model.vocab_size == vocab
    assert all(torch.equal(a, b) for a, b in zip(tensors, (*now.parameters(), *now.buffers())))
    assert model.hf.config.to_dict() == config
    assert torch.equal(_plain_logits(model), logits)


def _plain_logits(model) -> torch.Tensor:
    return torch.from_numpy(model.start().forward(PROMPT, n_logits=3).host_logits())


@pytest.mark.parametrize("strategy", ["lean", "hf"])
def test_a_restricted_drafter_leaves_the_model_it_drafts_with_as_it_was(
        strategy, lean_model, hf_model, target):
    draft = lean_model if strategy == "lean" else hf_model
    before, logits = _model_state(draft), _plain_logits(draft)
    drafter = DraftModelDrafter(target, draft, vocab_limit=8)
    params = SamplingParams(max_new_tokens=12)
    list(SpecEngine(target, drafter, k=3).generate(PROMPT, params))
    _assert_unchanged(draft, before, logits)
    assert drafter._session.head is not None  # the subset is the session's


@pytest.mark.parametrize("strategy", ["lean", "hf"])
def test_a_restricted_session_computes_the_models_logits_at_its_ids_and_minus_inf_elsewhere(
        strategy, lean_model, hf_model):
    model = lean_model if strategy == "lean" else hf_model
    ids = [1, 3, 5, 9, 30]
    full = _plain_logits(model)
    session = model.start()
    session.restrict_vocab(ids)
    part = torch.from_numpy(session.forward(PROMPT, n_logits=3).host_logits())
    # within an ulp: a matmul over 5 of the layer's rows may round unlike one over all
    torch.testing.assert_close(part[:, ids], full[:, ids], rtol=0, atol=1e-6)
    assert (part[:, [i for i in range(model.vocab_size) if i not in ids]] == float("-inf")).all()
    session.restrict_vocab(None)
    session.rewind(0)
    assert torch.equal(torch.from_numpy(session.forward(PROMPT, n_logits=3).host_logits()), full)


def test_a_model_that_caps_its_logits_after_the_output_layer_drafts_through_that_layer():
    model = tiny_llama(seed=1)
    model.hf.config.final_logit_softcapping = 30.0  # as Gemma's: a head of its own would skip it
    session = model.start()
    session.restrict_vocab([1, 3, 5])
    session.lighten_head()
    assert session.head is None


@pytest.mark.parametrize("dtype", [W4A8])
def test_a_lightened_drafter_leaves_the_8_bit_output_layer_in_the_model_it_shares(
        folder, dtype):
    target = TorchBackend().load(str(folder), device="cpu", dtype=dtype)
    draft = TorchBackend().load(str(folder), device="cpu", dtype=dtype)
    before, logits = _model_state(draft), _plain_logits(draft)
    drafters = [DraftModelDrafter(target, draft), DraftModelDrafter(target, draft, vocab_limit=16)]
    heads = [drafter._session.head for drafter in drafters]  # before vocab_limit cuts rows
    plain = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=20)))[-1]
    for drafter in drafters:
        done = list(SpecEngine(target, drafter, k=3).generate(
            PROMPT, SamplingParams(max_new_tokens=20)))[-1]
        assert done.token_ids == plain.token_ids
    assert isinstance(draft.hf.get_output_embeddings(), W8A8Linear)
    _assert_unchanged(draft, before, logits)
    assert isinstance(heads[0], w4a8.W4A8Linear)
    assert heads[1] is heads[0]  # quantized once per model
