"""Targets that keep more than a KV cache speculate losslessly on torch: hybrid recurrent ones
(the Gated DeltaNet of Qwen3.5, Qwen3.5-MoE and Qwen3-Next, NemotronH's Mamba-2) and
sliding-window ones (Gemma 3, a windowed Mistral, gpt-oss with its attention sinks), prompt
and reply longer than the window. A verify keeps a state per row, and keep selects the
accepted one without a second forward."""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from app.drafters.draft_model import DraftModelDrafter  # noqa: E402
from app.drafters.kinds import check  # noqa: E402
from app.drafters.ngram import NgramDrafter  # noqa: E402
from backends.torch import attention  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from backends.torch.rewind import MAX_VERIFY_ROWS  # noqa: E402
from tests.distributions import assert_follows, second_token_law, second_tokens  # noqa: E402
from tests.tiny_families import RECURRENT, WINDOW, WINDOWED, tiny_family  # noqa: E402

# repeats itself, so lookup drafts and some drafts are rejected; longer than the window
PROMPT = [5, 9, 3, 7, 11, 2, 4, 8, 13, 6, 10, 12, 5, 9, 3, 7]
NEW = 32
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0)
SEED = 2  # a seed whose random models decode varied, repeating text
assert len(PROMPT) + NEW > 3 * WINDOW


@functools.cache
def model(family: str, seed: int = SEED):
    """A family's tiny model on the torch backend's row-wise attention, as its load gives."""
    return tiny_family(family, seed, attention=attention.register())


@functools.cache
def plain(family: str) -> tuple[int, ...]:
    return decode(family, None, 1)


def decode(family: str, drafter, k: int) -> tuple[int, ...]:
    done = list(SpecEngine(model(family), drafter, k=k).generate(PROMPT, GREEDY))[-1]
    assert done.error is None, done.error
    if drafter is not None:
        assert done.stats.drafted > 0
    return done.token_ids


@pytest.mark.parametrize("family", (*WINDOWED, *RECURRENT))
def test_plain_decoding_equals_transformers_generate_on_its_own_attention(family):
    hf = model(family).hf
    hf.set_attn_implementation("eager")  # gpt-oss's sinks: eager is the one it declares
    try:
        ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)
    finally:
        hf.set_attn_implementation(attention.register())
    reply = tuple(ids[0, len(PROMPT):].tolist())
    assert plain(family) == reply[:len(plain(family))]


@pytest.mark.parametrize("k", (1, 2, 4))
@pytest.mark.parametrize("family", WINDOWED)
def test_a_windowed_target_with_ngram_equals_plain_past_the_window(family, k):
    assert decode(family, NgramDrafter(), k) == plain(family)


@pytest.mark.parametrize("k", (2, 4))
@pytest.mark.parametrize("family", WINDOWED)
def test_a_windowed_target_with_a_draft_model_equals_plain(family, k):
    drafter = DraftModelDrafter(model(family), model(family, seed=3))
    assert decode(family, drafter, k) == plain(family)


@pytest.mark.parametrize("k", (1, 2, 4, 7))
@pytest.mark.parametrize("family", RECURRENT)
def test_a_hybrid_target_with_ngram_equals_plain(family, k):
    assert decode(family, NgramDrafter(), k) == plain(family)


@pytest.mark.parametrize("k", (1, 2, 4, 7))
@pytest.mark.parametrize("family", RECURRENT)
def test_a_hybrid_target_with_a_hybrid_draft_model_equals_plain(family, k):
    drafter = DraftModelDrafter(model(family), model(family, seed=3))
    assert decode(family, drafter, k) == plain(family)


def _next_logits(session, token: int) -> np.ndarray:
    return session.forward([token], n_logits=1).host_logits()[-1]


@pytest.mark.parametrize("family", (*RECURRENT, *WINDOWED))
def test_keeping_part_of_a_verify_equals_decoding_the_kept_tokens_one_by_one(family):
    """The slot-selecting rewind against a re-decode oracle: the state a kept row selects is
    the one plain decoding of those tokens reaches, and keep runs no forward."""
    target = model(family)
    verify = [4, 17, 23, 8, 30, 2, 11]
    calls: list[int] = []
    handle = target.hf.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        for accepted in range(len(verify) + 1):
            spec = target.start()
            spec.forward(PROMPT)
            spec.forward(verify, n_logits=len(verify))
            before = len(calls)
            spec.keep(len(PROMPT), range(accepted))
            assert len(calls) == before and spec.length == len(PROMPT) + accepted
            oracle = target.start()
            for token in PROMPT + verify[:accepted]:
                oracle.forward([token])
            np.testing.assert_allclose(_next_logits(spec, 9), _next_logits(oracle, 9),
                                       rtol=0, atol=1e-4)
    finally:
        handle.remove()


@pytest.mark.parametrize("family", ("qwen3_5_text", "gemma3_text"))
def test_a_rewind_below_what_was_recorded_replays_the_kept_tokens(family):
    target, long = model(family), [int(t) for t in np.arange(MAX_VERIFY_ROWS + 9) % 40 + 2]
    session = target.start()
    session.forward(long)
    session.rewind(10)
    assert session.tokens == tuple(long[:10]) and session.length == 10
    fresh = target.start()
    fresh.forward(long[:10])
    np.testing.assert_allclose(_next_logits(session, 9), _next_logits(fresh, 9), rtol=0,
                               atol=1e-4)


@pytest.mark.parametrize("family", ("qwen3_next", "gemma3_text"))
def test_trees_are_refused_on_these_targets_with_the_reason_and_lookup_runs(family):
    target = model(family)
    reason = target.capabilities.reason
    assert "no tree" in reason
    with pytest.raises(SpecdeckError, match="cannot verify trees"):
        target.start().forward([3, 4, 5], n_logits=3, parents=[-1, 0, 0])
    refusal = check("eagle3:tree", TorchBackend.runs, capabilities=target.capabilities,
                    target=target.name)
    assert refusal.message == (f"drafter 'eagle3:tree' drafts trees, and {target.name} "
                               f"verifies chains only: {reason}: drop --tree to draft eagle3 "
                               "chains")
    assert build_drafter("ngram", target, backend=TorchBackend()).name == "ngram"


def test_sampled_speculation_on_a_hybrid_target_follows_the_target():
    target, n = tiny_family("qwen3_5_text", SEED, attention=attention.register()), 300
    target.eos_token_ids = frozenset()  # its own copy: the others stop at their end token
    drafter = DraftModelDrafter(target, model("qwen3_5_text", seed=3))
    counts = second_tokens(target, PROMPT, drafter, n)
    assert_follows(counts, second_token_law(target, PROMPT) * n)


@pytest.mark.parametrize("family", ("qwen3_5_text", "gemma3_text"))
def test_loaded_in_bfloat16_a_long_prompt_and_wide_verifies_equal_plain(family, tmp_path):
    """Through the backend's load: padded 1-row forwards, prompts and verifies split into
    the exact row blocks (16 rows here), each block recorded as its own forward's part."""
    from tests.tiny import save_hf_folder

    folder = save_hf_folder(model(family), tmp_path / family)
    target = TorchBackend().load(str(folder), device="cpu", dtype="bfloat16")
    assert target.min_rows == 2 and target.row_block < 20
    prompt = (PROMPT * 3)[:40]
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    engine = SpecEngine(target)
    plain_ids = list(engine.generate(prompt, params, drafter=None, k=1))[-1].token_ids
    done = list(engine.generate(prompt, params, drafter=NgramDrafter(), k=20))[-1]
    assert done.error is None and done.stats.drafted > 20
    assert done.token_ids == plain_ids


def test_attention_sinks_are_computed_row_wise_as_transformers_eager_computes_them():
    hf = model("gpt_oss").hf
    ids = torch.tensor([[int(t) for t in np.arange(MAX_VERIFY_ROWS + 12) % 40 + 2]])
    with torch.inference_mode():
        ours = [hf(input_ids=ids[:, :n]).logits for n in (5, ids.shape[1])]
        hf.set_attn_implementation("eager")
        try:
            theirs = [hf(input_ids=ids[:, :n]).logits for n in (5, ids.shape[1])]
        finally:
            hf.set_attn_implementation(attention.register())
    for mine, eager in zip(ours, theirs):
        torch.testing.assert_close(mine, eager, rtol=0, atol=1e-5)


def _recurrent_bytes(session) -> int:
    """What a torch session's recurrent layers hold now: states, recorded slots, conv input."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    tensors = []
    for layer in session._cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            tensors += [layer.recurrent_states[0], layer.conv_states[0],
                        *layer.recurrent_states_history[0]]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("family", RECURRENT)
def test_the_counted_state_and_slots_are_what_a_verify_holds(family):
    from app.catalogue.states import stream_state

    target, k = model(family), 4
    counted = stream_state(target.hf.config.to_dict())
    assert counted.layers
    session = target.start()
    session.forward(PROMPT)
    session.rewind(len(PROMPT))  # commits: what plain decoding keeps between tokens
    assert _recurrent_bytes(session) == counted.bytes(dtype_bytes=4)
    session.forward(PROMPT[:k + 1], n_logits=k + 1)  # a verify of k drafts, before keep
    assert _recurrent_bytes(session) == counted.bytes(4) + counted.slot_bytes(k, 4)


def test_an_attention_only_model_counts_no_state():
    from app.catalogue.states import stream_state

    assert stream_state(model("gemma3_text").hf.config.to_dict()).bytes(2) == 0


@pytest.mark.parametrize("family", ("qwen3_5_text", "nemotron_h"))
def test_the_planner_counts_a_hybrids_kv_on_its_attention_layers_and_its_state_slots(
        family, tmp_path):
    from app.catalogue import planner
    from app.catalogue.sizing import _kv_bytes
    from app.catalogue.states import stream_state
    from tests.tiny import save_hf_folder

    target = model(family)
    folder = save_hf_folder(target, tmp_path / family)
    plan = planner.plan(str(folder), "torch", "cpu", memory=2**34)
    fit, width = plan.fit, _kv_bytes(plan.fit.dtype)
    stream = stream_state(target.hf.config.to_dict())
    assert fit.target_kv_per_token == 1 * 2 * 8 * 2 * width  # one attention layer of four
    assert fit.state_bytes == stream.bytes(width) > 0
    assert fit.slot_bytes == stream.slot_bytes(plan.choice.k, width) > 0
    rows = dict(fit.rows())
    assert rows["state per stream"].endswith(f"slots ({plan.choice.k + 1})")
