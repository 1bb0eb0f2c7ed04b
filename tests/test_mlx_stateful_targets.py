"""Targets that keep more than a KV cache speculate losslessly on MLX: hybrid recurrent ones
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next, NemotronH) through a checkpoint of their states and a
re-decode, Gemma 3 through a window with spare rows; prompt and reply longer than the window.
The tiny models are tests/tiny_families.py's, their weights loaded by the MLX backend."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
torch = pytest.importorskip("torch")

import mlx.core as mx  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from app.drafters.kinds import check  # noqa: E402
from app.drafters.ngram import NgramDrafter  # noqa: E402
from backends.mlx import RUNS  # noqa: E402
from backends.mlx.backend import MlxBackend  # noqa: E402
from backends.mlx.drafters import DraftModelDrafter  # noqa: E402
from backends.mlx.rewind import SPARE, WindowCache  # noqa: E402
from backends.torch import attention  # noqa: E402
from tests.tiny import mlx_twin  # noqa: E402
from tests.tiny_families import WINDOW, tiny_family  # noqa: E402

RECURRENT = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h", "falcon_h1")
FAMILIES = (*RECURRENT, "gemma3_text")  # mlx-lm builds these as transformers does
PROMPT = [5, 9, 3, 7, 11, 2, 4, 8, 13, 6, 10, 12, 5, 9, 3, 7]
NEW = 32
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0)
SEED = 2
_FOLDERS = tempfile.TemporaryDirectory(prefix="specdeck-mlx-families-")


@functools.cache
def torch_model(family: str, seed: int = SEED):
    """A family's tiny model on torch, decoding past its end token (this module's copy): the
    tiny Qwen3.5-MoE would stop after 5 tokens."""
    target = tiny_family(family, seed, attention=attention.register())
    target.eos_token_ids = frozenset()
    return target


@functools.cache
def model(family: str, seed: int = SEED):
    """A family's tiny model on MLX, the torch one's weights (fp32 on the CPU)."""
    target = mlx_twin(torch_model(family, seed), Path(_FOLDERS.name) / f"{family}-{seed}")
    target.eos_token_ids = frozenset()
    return target


@functools.cache
def plain(family: str) -> tuple[int, ...]:
    return decode(model(family), None, 1)


def decode(target, drafter, k: int) -> tuple[int, ...]:
    done = list(SpecEngine(target, drafter, k=k).generate(PROMPT, GREEDY))[-1]
    assert done.error is None, done.error
    assert len(done.token_ids) == NEW
    if drafter is not None:
        assert done.stats.drafted > 0
    return done.token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_decoding_on_mlx_equals_plain_decoding_on_torch(family):
    torch_ids = list(SpecEngine(torch_model(family)).generate(PROMPT, GREEDY))[-1].token_ids
    assert plain(family) == torch_ids


@pytest.mark.parametrize("k", (1, 2, 4, 7))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_stateful_target_with_ngram_equals_plain_on_mlx(family, k):
    assert decode(model(family), NgramDrafter(), k) == plain(family)


@pytest.mark.parametrize("k", (2, 4))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_stateful_target_with_a_draft_model_of_its_family_equals_plain_on_mlx(family, k):
    drafter = DraftModelDrafter(model(family), model(family, seed=3))
    assert decode(model(family), drafter, k) == plain(family)


def _next_logits(session, token: int) -> np.ndarray:
    return session.forward([token], n_logits=1).host_logits()[-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_keeping_part_of_a_verify_equals_decoding_the_kept_tokens_one_by_one(family):
    """The rewind against a re-decode oracle: after keep, the next logits are those of
    plain one-token decoding of the kept tokens."""
    target, verify = model(family), [4, 17, 23, 8, 30, 2, 11]
    for accepted in range(len(verify) + 1):
        spec = target.start()
        spec.forward(PROMPT)
        spec.forward(verify, n_logits=len(verify))
        spec.keep(len(PROMPT), range(accepted))
        assert spec.length == len(PROMPT) + accepted
        assert spec.tokens == tuple(PROMPT + verify[:accepted])
        oracle = target.start()
        for token in PROMPT + verify[:accepted]:
            oracle.forward([token])
        np.testing.assert_allclose(_next_logits(spec, 9), _next_logits(oracle, 9),
                                   rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ("qwen3_5_text", "gemma3_text"))
def test_a_rewind_past_every_checkpoint_or_spare_row_replays_the_kept_tokens(family):
    target = model(family)
    long = [int(t) for t in np.arange(3 * SPARE) % 40 + 2]
    session = target.start()
    for token in long:  # one forward a token: more than the checkpoints a session keeps
        session.forward([token])
    session.rewind(10)
    assert session.tokens == tuple(long[:10]) and session.length == 10
    fresh = target.start()
    fresh.forward(long[:10])
    np.testing.assert_allclose(_next_logits(session, 9), _next_logits(fresh, 9), rtol=0,
                               atol=1e-4)


def test_a_windowed_session_holds_its_window_and_spare_rows_not_the_whole_context():
    session = model("gemma3_text").start()
    for token in [int(t) for t in np.arange(400) % 40 + 2]:
        session.forward([token])
    windows = [c for c in session._cache if isinstance(c, WindowCache)]
    assert windows and all(c.window == WINDOW for c in windows)
    assert all(WINDOW - 1 + SPARE <= c.stored <= WINDOW - 1 + SPARE + c.step for c in windows)
    assert session.length == 400


@pytest.mark.parametrize("family", ("qwen3_next", "gemma3_text"))
def test_trees_are_refused_on_these_targets_with_the_reason_and_lookup_runs(family):
    target = model(family)
    reason = target.capabilities.reason
    assert target.capabilities.rewind and "no tree" in reason
    with pytest.raises(SpecdeckError, match="cannot verify trees on MLX"):
        target.start().forward([3, 4, 5], n_logits=3, parents=[-1, 0, 0])
    refusal = check("eagle3:tree", RUNS, capabilities=target.capabilities, target=target.name)
    assert refusal.message == (f"drafter 'eagle3:tree' drafts trees, and {target.name} "
                               f"verifies chains only: {reason}: drop --tree to draft eagle3 "
                               "chains, or use --backend torch for trees")
    assert build_drafter("ngram", target, backend=MlxBackend()).name == "ngram"


def _multimodal_layout(text_folder: Path, folder: Path) -> Path:
    """text_folder as Qwen3.5's published checkpoints lay it out: model_type qwen3_5 (or
    qwen3_5_moe) with a text_config, `model.language_model.*` tensors, `mtp.*` beside them."""
    folder.mkdir()
    text = json.loads((text_folder / "config.json").read_text())
    config = {"model_type": text["model_type"].removesuffix("_text"), "text_config": text,
              "architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(str(text_folder / "model.safetensors"))
    laid = {name.replace("model.", "model.language_model.", 1)
            if name.startswith("model.") else name: value for name, value in weights.items()}
    hidden = text["hidden_size"]
    laid |= {"mtp.fc.weight": np.ones((hidden, 2 * hidden), np.float32),
             "mtp.norm.weight": np.ones(hidden, np.float32)}
    save_file(laid, str(folder / "model.safetensors"))
    for name in text_folder.iterdir():
        if name.name.startswith("tokenizer") or name.name == "special_tokens_map.json":
            (folder / name.name).write_bytes(name.read_bytes())
    return folder


@pytest.mark.parametrize("family", ("qwen3_5_text", "qwen3_5_moe_text"))
def test_qwen3_5s_multimodal_layout_loads_as_its_text_only_layout(family, tmp_path):
    text_folder = Path(_FOLDERS.name) / f"{family}-{SEED}"
    model(family)  # writes text_folder
    laid = MlxBackend().load(str(_multimodal_layout(text_folder, tmp_path / "vl")),
                             device="cpu", dtype="float32")
    ours, theirs = laid.start().logits(PROMPT, 4), model(family).start().logits(PROMPT, 4)
    np.testing.assert_array_equal(np.array(ours), np.array(theirs))
    with torch.no_grad():
        want = torch_model(family).hf(torch.tensor([PROMPT])).logits[0, -4:].numpy()
    np.testing.assert_allclose(np.array(ours.astype(mx.float32)), want, rtol=0, atol=1e-4)
