"""Batched streams' forwards: several sessions' rows in one lean forward give each session
what its own forward gives, bit for bit where the load-time check makes rows exact (bf16, GGUF
blocks), and leave every session as its own forward would."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

torch = pytest.importorskip("torch")

from app.core.protocols import ForwardCall  # noqa: E402
from backends.torch import gguf_model  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from backends.torch.session import LeanSession  # noqa: E402
from tests.tiny import save_gguf, save_hf_folder, tiny_llama  # noqa: E402

PROMPTS = ([3, 4, 5, 6, 7, 8], [9, 10, 11], list(range(12, 40)))  # the last: over a block
STEPS = ((5, 6, 7), (9,), (4, 4, 4, 4, 4))


def _solo(model, prompt):
    session = model.start()
    outs = [session.forward(prompt, n_logits=2).host_logits()]
    outs += [session.forward(list(step), n_logits=len(step)).host_logits() for step in STEPS]
    return outs, session.tokens, session.length


def _together(model):
    sessions = [model.start() for _ in PROMPTS]
    outs = [[o.host_logits()] for o in model.forward_batch(
        [ForwardCall(s, tuple(p), 2) for s, p in zip(sessions, PROMPTS)])]
    for step in STEPS:
        for mine, o in zip(outs, model.forward_batch(
                [ForwardCall(s, step, len(step)) for s in sessions])):
            mine.append(o.host_logits())
    return outs, sessions


def _assert_each_as_alone(model):
    assert isinstance(model.start(), LeanSession)
    together, sessions = _together(model)
    for prompt, outs, session in zip(PROMPTS, together, sessions):
        alone, tokens, length = _solo(model, prompt)
        assert session.tokens == tokens and session.length == length
        for a, b in zip(alone, outs):
            assert np.array_equal(a, b)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    folder = save_hf_folder(tiny_llama(seed=1), tmp_path_factory.mktemp("bf16"))
    return TorchBackend().load(str(folder), device="cpu", dtype="bfloat16")


def test_sessions_batched_in_one_bf16_forward_get_the_bits_each_gets_alone(bf16):
    assert bf16.min_rows > 1  # padding, and blocks cut across the calls' rows
    _assert_each_as_alone(bf16)


@pytest.mark.skipif(gguf_model.unavailable_reason() is not None,
                    reason=f"no GGUF kernel here: {gguf_model.unavailable_reason()}")
def test_sessions_batched_in_one_gguf_forward_get_the_bits_each_gets_alone(tmp_path):
    path = save_gguf(tiny_llama(seed=4, hidden=64), tmp_path / "wide.gguf", int(T.Q8_0))
    _assert_each_as_alone(TorchBackend().load(str(path), device="cpu", dtype="auto"))


def test_a_batch_with_a_session_the_lean_forward_does_not_run_runs_each_alone(bf16):
    hf = tiny_llama(seed=1)  # unfused projections: transformers' forward
    calls = [ForwardCall(hf.start(), (3, 4, 5), 1), ForwardCall(hf.start(), (6, 7), 1)]
    outs = hf.forward_batch(calls)
    assert [o.argmax for o in outs] == [hf.start().forward([3, 4, 5]).argmax,
                                        hf.start().forward([6, 7]).argmax]
