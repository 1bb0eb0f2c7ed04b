"""The MLX backend: loading, rewind, refusals, hidden states, parity with torch, sampling.

The oracle equivalence suite runs on MLX through tests/test_engine.py; this file holds what
is MLX's own. Runs on Linux through MLX's CPU build (mlx[cpu]).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from scipy.stats import chisquare  # noqa: E402

from app.cli import main  # noqa: E402
from app.core.engine import SpecEngine  # noqa: E402
from app.core.sampling import warp  # noqa: E402
from app.core.types import Draft, SamplingParams, SpecdeckError  # noqa: E402
from app.core.verify import verify_sampled  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from app.drafters.ngram import NgramDrafter  # noqa: E402
from backends import load_backend  # noqa: E402
from backends.gguf import converted_path, record_source  # noqa: E402
from backends.mlx.backend import MlxBackend, MlxModel  # noqa: E402
from backends.mlx.drafters import DraftModelDrafter  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from tests.tiny import mlx_twin, save_hf_folder, tiny_llama, tiny_tokenizer  # noqa: E402

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]


def greedy(model, prompt, n: int, drafter=None, k: int = 4) -> list[int]:
    engine = SpecEngine(model, drafter, k=k)
    done = list(engine.generate(prompt, SamplingParams(max_new_tokens=n)))[-1]
    assert done.error is None, done.error
    return list(done.token_ids)


# --- loading -------------------------------------------------------------------------------

def test_cli_backend_mlx_loads_the_mlx_adapter():
    assert isinstance(load_backend("mlx"), MlxBackend)


def test_loaded_model_reports_device_dtype_vocab_eos_and_memory(mlx_target):
    assert isinstance(mlx_target, MlxModel)
    assert (mlx_target.device, mlx_target.dtype) == ("cpu", "float32")
    assert mlx_target.vocab_size == 48 and mlx_target.context_length == 256
    assert mlx_target.eos_token_ids == frozenset({1})
    assert mlx_target.weights_bytes() == sum(p.numel() * 4 for p in tiny_llama(1).hf.parameters())
    mlx_target.start().forward(PROMPT)
    assert mlx_target.peak_memory_bytes() >= mlx_target.active_memory_bytes() > 0


def test_dtype_flag_casts_the_weights(mlx_target, tmp_path):
    folder = save_hf_folder(tiny_llama(1), tmp_path / "m")
    model = MlxBackend().load(str(folder), device="cpu", dtype="bfloat16")
    assert model.dtype == "bfloat16"
    assert model.weights_bytes() == mlx_target.weights_bytes() // 2


def test_a_gguf_path_uses_its_converted_folder_without_converting_again(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not read: the converted folder next to it exists")
    folder = save_hf_folder(tiny_llama(1), converted_path(gguf))
    record_source(gguf, folder)  # what a finished conversion writes last
    model = MlxBackend().load(str(gguf), device="cpu")
    assert model.name == "tiny" and model.vocab_size == 48


def test_a_quantized_mlx_community_style_folder_loads_and_decodes_losslessly(tmp_path):
    from mlx_lm import convert
    source = save_hf_folder(tiny_llama(1), tmp_path / "fp32")
    convert(str(source), str(tmp_path / "q4"), quantize=True, q_group_size=32, q_bits=4)
    model = MlxBackend().load(str(tmp_path / "q4"), device="cpu")
    assert model.dtype == "4-bit/float32"
    assert any(v.dtype == mx.uint32 for _, v in tree_flatten(model.net.parameters()))
    plain = greedy(model, PROMPT, 20)
    assert greedy(model, PROMPT, 20, NgramDrafter(), k=3) == plain
    assert greedy(model, PROMPT, 20, DraftModelDrafter(model, model), k=4) == plain


@pytest.mark.parametrize("path, fix", [("missing-folder", "specdeck pull"),
                                       ("config.json", "neither a folder nor a .gguf")])
def test_a_bad_path_is_refused_naming_the_fix(tmp_path, path, fix):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SpecdeckError, match=fix):
        MlxBackend().load(str(tmp_path / path))


@pytest.mark.parametrize("model_type, weights", [("no-such-arch", "valid"),
                                                  ("llama", "truncated")])
def test_an_unknown_architecture_or_a_corrupt_file_is_a_user_error(tmp_path, model_type,
                                                                  weights):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"w": mx.zeros(4)})
    if weights == "truncated":
        (tmp_path / "model.safetensors").write_bytes(b"\x10")
    with pytest.raises(SpecdeckError, match="could not load .*--backend torch"):
        MlxBackend().load(str(tmp_path))


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="this MLX build has a GPU")
def test_asking_for_a_gpu_on_the_cpu_build_names_the_fix(tmp_path):
    with pytest.raises(SpecdeckError, match="--device cpu"):
        MlxBackend().load(str(tmp_path), device="gpu")


def test_generate_with_backend_mlx_from_the_command_line(tmp_path, capsys):
    folder = save_hf_folder(tiny_llama(1), tmp_path / "m")
    code = main(["generate", "--backend", "mlx", "--target", str(folder), "--drafter", "draft",
                 "--draft", str(folder), "--prompt", "w5 w9 w12 w5", "--max-new-tokens", "12",
                 "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["acceptance_rate"] == 1.0 and result["n_new_tokens"] == 12


# --- rewind and refusals -------------------------------------------------------------------

def test_rewind_then_other_tokens_equals_a_fresh_session(mlx_target):
    session = mlx_target.start()
    session.forward(PROMPT + [3, 4, 5, 6], n_logits=1)
    session.rewind(len(PROMPT) - 2)
    rewound = session.forward(PROMPT[-2:] + [8, 2], n_logits=4).host_logits()
    fresh = mlx_target.start().forward(PROMPT + [8, 2], n_logits=4).host_logits()
    np.testing.assert_allclose(rewound, fresh, rtol=0, atol=1e-5)
    assert session.length == len(PROMPT) + 2


def test_rewind_past_the_cache_is_an_error(mlx_target):
    session = mlx_target.start()
    session.forward(PROMPT)
    with pytest.raises(ValueError, match="cannot rewind"):
        session.rewind(len(PROMPT) + 1)
    assert session.length == len(PROMPT)


def _tiny_mamba(folder: Path) -> Path:
    from mlx_lm.models import mamba
    config = {"model_type": "mamba", "vocab_size": 48, "hidden_size": 32,
              "intermediate_size": 64, "state_size": 8, "num_hidden_layers": 2,
              "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
              "time_step_rank": 4, "tie_word_embeddings": True}
    net = mamba.Model(mamba.ModelArgs.from_dict(config))
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(net.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_a_recurrent_model_without_attention_speculates_equal_to_plain(tmp_path):
    """Mamba's states alone (no attention layer counts the tokens): ngram drafts, each
    rejection rewound to a checkpoint of its states."""
    target = MlxBackend().load(str(_tiny_mamba(tmp_path / "m")), device="cpu")
    prompt = PROMPT * 3
    plain = greedy(target, prompt, 24, k=1)
    assert target.capabilities.rewind and not target.capabilities.tree_attention
    assert greedy(target, prompt, 24, drafter=NgramDrafter(), k=4) == plain


def test_gemma3_decodes_past_its_window_as_torch_does_and_speculates_equal_to_plain(tmp_path):
    """Gemma 3's window: plain decoding (a second prompt sharing the first's prefix) and
    ngram speculation give torch's tokens; trees are refused with the reason."""
    from backends.torch import attention
    from tests.tiny_families import WINDOW, tiny_family

    torch_target = tiny_family("gemma3_text", 2, attention=attention.register())
    mlx_target = mlx_twin(torch_target, tmp_path / "gemma3")
    prompt, n = PROMPT * 2, 3 * WINDOW
    engine = SpecEngine(mlx_target)
    for ask in (prompt, prompt[:-3] + [4, 4]):
        want = greedy(torch_target, ask, n)
        assert greedy(mlx_target, ask, n) == want
        done = list(engine.generate(ask, SamplingParams(max_new_tokens=n)))[-1]
        assert done.error is None and list(done.token_ids) == want
        assert greedy(mlx_target, ask, n, drafter=NgramDrafter(), k=4) == want
    assert mlx_target.capabilities.rewind and not mlx_target.capabilities.tree_attention
    assert "sliding-window" in mlx_target.capabilities.reason
    assert build_drafter("ngram", mlx_target, backend=MlxBackend()).name == "ngram"


# --- hidden states -------------------------------------------------------------------------

def test_captured_hidden_states_match_the_torch_hooks(target, mlx_target):
    ours = mlx_target.start(capture_layers=[0, 1])
    theirs = target.start(capture_layers=[0, 1])
    for chunk in (PROMPT, [3, 4]):  # a prefill, then a step on the cache
        got = ours.forward(chunk, n_logits=1).hidden_states
        want = theirs.forward(chunk, n_logits=1).hidden_states
        assert sorted(got) == [0, 1]
        for layer in (0, 1):
            assert got[layer].shape == (len(chunk), 32)
            np.testing.assert_allclose(np.array(got[layer]), want[layer].numpy(), atol=1e-5)


def test_a_prefill_in_chunks_gives_the_same_rows_and_hidden_states(target, mlx_target,
                                                                   monkeypatch):
    monkeypatch.setattr("backends.mlx.backend.PREFILL_CHUNK", 4)
    got = mlx_target.start(capture_layers=[1]).forward(PROMPT, n_logits=2)
    want = target.start(capture_layers=[1]).forward(PROMPT, n_logits=2)
    np.testing.assert_allclose(got.host_logits(), want.host_logits(), atol=1e-4)
    np.testing.assert_allclose(np.array(got.hidden_states[1]), want.hidden_states[1].numpy(),
                               atol=1e-5)


def test_a_session_without_capture_gets_no_hidden_states_from_a_hooked_model(mlx_target):
    mlx_target.start(capture_layers=[1])
    assert mlx_target.start().forward(PROMPT).hidden_states == {}


def test_capturing_a_layer_the_model_lacks_is_refused(mlx_target):
    with pytest.raises(SpecdeckError, match="2 layers"):
        mlx_target.start(capture_layers=[2])


# --- parity with torch ---------------------------------------------------------------------

def test_same_weights_give_the_same_logits_as_torch_within_fp32_tolerance(target, mlx_target):
    ours, theirs = mlx_target.start(), target.start()
    for chunk, rows in ((PROMPT, len(PROMPT)), ([3, 4, 5], 3), ([6], 1)):
        got = ours.forward(chunk, n_logits=rows)
        want = theirs.forward(chunk, n_logits=rows)
        np.testing.assert_allclose(got.host_logits(), want.host_logits(), rtol=0, atol=1e-4)
        assert got.argmax == want.argmax


@pytest.mark.slow
def test_smollm2_gives_the_torch_backends_greedy_tokens(smollm2_gguf):
    torch_model = TorchBackend().load(str(smollm2_gguf), device="cpu",
                                      dtype="float32")  # converts it once
    mlx_model = MlxBackend().load(str(smollm2_gguf), device="cpu")
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    prompt = torch_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    first = mlx_model.start().forward(prompt).host_logits()
    np.testing.assert_allclose(first, torch_model.start().forward(prompt).host_logits(),
                               rtol=0, atol=2e-3)
    expected = greedy(torch_model, prompt, 24)
    assert greedy(mlx_model, prompt, 24) == expected
    assert greedy(mlx_model, prompt, 24, NgramDrafter(), k=4) == expected


# --- the sampling pipeline on MLX rows -----------------------------------------------------

SMALL_VOCAB = 6
DRAWS = 40_000


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A target and an unrelated draft over 6 tokens, so every outcome can be counted."""
    folder = tmp_path_factory.mktemp("small")
    return (mlx_twin(tiny_llama(3, vocab=SMALL_VOCAB), folder / "target"),
            mlx_twin(tiny_llama(4, vocab=SMALL_VOCAB), folder / "draft"))


def test_drafter_q_is_the_warped_draft_row_and_its_tokens_follow_q(small_pair):
    target, draft = small_pair
    params = SamplingParams(temperature=1.5, top_k=5)
    drafter = DraftModelDrafter(target, draft)
    context = [t % SMALL_VOCAB for t in PROMPT]  # ids past the vocabulary would read stray memory
    drafter.begin(context, None, params, np.random.default_rng(0))
    q = warp(draft.start().forward(context).host_logits()[-1], params)
    counts = np.zeros(SMALL_VOCAB)
    for _ in range(800):
        proposal = drafter.propose(context, k=2)
        np.testing.assert_allclose(proposal.probs[0], q, atol=1e-6)
        counts[proposal.tokens[0]] += 1
    assert counts[q == 0].sum() == 0
    assert chisquare(counts[q > 0], q[q > 0] * counts.sum()).pvalue > 1e-4


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_p=0.8),
                                    SamplingParams(temperature=1.3, top_k=4)],
                         ids=["T1", "T0.7-p0.8", "T1.3-k4"])
def test_rejection_sampling_on_mlx_rows_emits_the_target_distribution(small_pair, params):
    """The first token a verification step emits is distributed as warp(target row)."""
    target, draft = small_pair
    context = [t % SMALL_VOCAB for t in PROMPT]
    drafter = DraftModelDrafter(target, draft)
    drafter.begin(context, None, params, np.random.default_rng(1))
    q = drafter.propose(context, k=1).probs[0]
    rows = {d: warp(target.start().forward(context + [d], n_logits=2).host_logits(), params)
            for d in range(SMALL_VOCAB)}  # the verify rows for each possible draft token
    p = rows[0][0]
    rng = np.random.default_rng(2)
    drafts = rng.choice(SMALL_VOCAB, size=DRAWS, p=q)
    counts = np.zeros(SMALL_VOCAB)
    for d in drafts:
        verdict = verify_sampled(Draft(tokens=(int(d),), probs=q[None]), rows[int(d)], rng)
        counts[(int(d) if verdict.n_accepted else verdict.next_token)] += 1
    assert counts[p == 0].sum() == 0
    assert chisquare(counts[p > 0], p[p > 0] * DRAWS).pvalue > 1e-4
    assert 0.5 * np.abs(counts / DRAWS - p).sum() < 3 * np.sqrt(SMALL_VOCAB / DRAWS)


def test_plain_sampled_decoding_on_mlx_draws_from_the_same_warped_rows(small_pair):
    target, _ = small_pair
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=1)
    context = [t % SMALL_VOCAB for t in PROMPT]
    p = warp(target.start().forward(context).host_logits()[-1], params)
    engine = SpecEngine(target)
    counts = np.zeros(SMALL_VOCAB)
    for seed in range(800):
        done = list(engine.generate(context, replace(params, seed=seed)))
        counts[done[-1].token_ids[0]] += 1
    assert counts[p == 0].sum() == 0
    assert chisquare(counts[p > 0], p[p > 0] * counts.sum()).pvalue > 1e-4


def test_torch_and_mlx_verify_rows_warp_to_the_same_probabilities(target, mlx_target):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95)
    rows = [m.start().forward(PROMPT + [3, 4], n_logits=3).host_logits()
            for m in (target, mlx_target)]
    np.testing.assert_allclose(warp(rows[0], params), warp(rows[1], params), atol=1e-5)
