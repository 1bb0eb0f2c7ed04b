"""The windowed targets mlx-lm alone reads other than transformers load and decode on MLX as
on torch, and speculate losslessly past the window: gpt-oss (its fused experts as
transformers 5 saves them, its attention sinks, its untruncated YaRN) and a Mistral with
sliding_window set (every layer windowed). The tiny models are tests/tiny_families.py's,
their weights loaded by the MLX backend (backends/mlx/layouts.py, backends/mlx/exact.py)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
torch = pytest.importorskip("torch")

import mlx.core as mx  # noqa: E402

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from app.drafters.ngram import NgramDrafter  # noqa: E402
from backends.mlx.drafters import DraftModelDrafter  # noqa: E402
from backends.mlx.exact import yarn_periods  # noqa: E402
from backends.mlx.rewind import SPARE, WINDOW_CHAINS, WindowCache  # noqa: E402
from backends.torch import attention  # noqa: E402
from tests.tiny import mlx_twin  # noqa: E402
from tests.tiny_families import WINDOW, tiny_family  # noqa: E402

FAMILIES = ("gpt_oss", "mistral")
# repeats itself, so lookup drafts and some drafts are rejected; longer than the window
PROMPT = [5, 9, 3, 7, 11, 2, 4, 8, 13, 6, 10, 12, 5, 9, 3, 7]
# a prompt whose reply crosses the window cache's first buffer growth (mlx-lm's KVCache.step,
# 256 rows), where a WindowCache drops its oldest rows; past the tiny configs' 256 positions,
# which bound the engine (CONTEXT below) and not the models (RoPE reads any position)
LONG = [int(t) for t in np.arange(240) % 37 + 2]
CONTEXT = 512
NEW = 32
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0)
SEED = 2
YARN_20B = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}
assert len(PROMPT) + NEW > 3 * WINDOW and len(LONG) + NEW > 256 > WINDOW - 1 + SPARE
_FOLDERS = tempfile.TemporaryDirectory(prefix="specdeck-mlx-windows-")


@functools.cache
def torch_model(family: str, seed: int = SEED):
    """A family's tiny model on torch's row-wise attention, decoding past its end token."""
    target = tiny_family(family, seed, attention=attention.register())
    target.eos_token_ids, target.context_length = frozenset(), CONTEXT
    return target


@functools.cache
def model(family: str, seed: int = SEED):
    """The torch model's weights, saved as transformers saves them, loaded on MLX (fp32)."""
    target = mlx_twin(torch_model(family, seed), Path(_FOLDERS.name) / f"{family}-{seed}")
    target.eos_token_ids, target.context_length = frozenset(), CONTEXT
    return target


def decode(target, drafter, k: int, prompt: list[int]) -> tuple[int, ...]:
    done = list(SpecEngine(target, drafter, k=k).generate(prompt, GREEDY))[-1]
    assert done.error is None, done.error
    assert len(done.token_ids) == NEW
    if drafter is not None:
        assert done.stats.drafted > 0
    return done.token_ids


@functools.cache
def plain(family: str, prompt: tuple[int, ...] = tuple(PROMPT)) -> tuple[int, ...]:
    return decode(model(family), None, 1, list(prompt))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_logits_on_mlx_are_transformers_past_the_window(family):
    ids = [int(t) for t in np.arange(3 * WINDOW + 5) % 40 + 2]
    with torch.no_grad():
        want = torch_model(family).hf(torch.tensor([ids])).logits[0].numpy()
    got = model(family).start().logits(ids, len(ids)).astype(mx.float32)
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("prompt", (PROMPT, LONG), ids=("short", "long"))
@pytest.mark.parametrize("family", FAMILIES)
def test_gpt_oss_and_a_windowed_mistral_on_mlx_decode_as_torch_does(family, prompt):
    torch_ids = list(SpecEngine(torch_model(family)).generate(prompt, GREEDY))[-1].token_ids
    assert plain(family, tuple(prompt)) == torch_ids


@pytest.mark.parametrize("prompt", (PROMPT, LONG), ids=("short", "long"))
@pytest.mark.parametrize("k", (1, 2, 4))
@pytest.mark.parametrize("family", FAMILIES)
def test_windowed_targets_on_mlx_with_ngram_speculate_identical_to_plain_past_the_window(
        family, k, prompt):
    assert decode(model(family), NgramDrafter(), k, prompt) == plain(family, tuple(prompt))


@pytest.mark.parametrize("prompt", (PROMPT, LONG), ids=("short", "long"))
@pytest.mark.parametrize("k", (2, 4))
@pytest.mark.parametrize("family", FAMILIES)
def test_windowed_targets_on_mlx_with_a_draft_model_speculate_identical_to_plain(
        family, k, prompt):
    drafter = DraftModelDrafter(model(family), model(family, seed=3))
    assert decode(model(family), drafter, k, prompt) == plain(family, tuple(prompt))


def _next_logits(session, token: int) -> np.ndarray:
    return session.forward([token], n_logits=1).host_logits()[-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_keeping_part_of_a_verify_past_the_window_equals_decoding_the_kept_tokens(family):
    target, verify = model(family), [4, 17, 23, 8, 30, 2, 11]
    for accepted in range(len(verify) + 1):
        spec = target.start()
        spec.forward(PROMPT)
        spec.forward(verify, n_logits=len(verify))
        spec.keep(len(PROMPT), range(accepted))
        assert spec.length == len(PROMPT) + accepted
        oracle = target.start()
        for token in PROMPT + verify[:accepted]:
            oracle.forward([token])
        np.testing.assert_allclose(_next_logits(spec, 9), _next_logits(oracle, 9),
                                   rtol=0, atol=1e-4)


def test_every_layer_of_a_windowed_mistral_on_mlx_holds_its_window_not_the_context():
    session = model("mistral").start()
    for token in [int(t) for t in np.arange(300) % 40 + 2]:
        session.forward([token])
    assert all(isinstance(c, WindowCache) and c.window == WINDOW for c in session._cache)
    assert all(c.stored <= WINDOW - 1 + SPARE + c.step for c in session._cache)
    assert session.length == 300


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rewind_past_every_spare_row_on_mlx_replays_the_kept_tokens(family):
    session, long = model(family).start(), [int(t) for t in np.arange(300) % 40 + 2]
    for token in long:  # one forward a token: the windows drop rows the rewind then needs
        session.forward([token])
    assert any(c.start > 10 for c in session._cache if isinstance(c, WindowCache))
    session.rewind(10)
    assert session.tokens == tuple(long[:10]) and session.length == 10
    fresh = model(family).start()
    fresh.forward(long[:10])
    np.testing.assert_allclose(_next_logits(session, 9), _next_logits(fresh, 9), rtol=0,
                               atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_trees_are_refused_on_these_targets_on_mlx_for_their_window(family):
    target = model(family)
    assert target.capabilities.reason == WINDOW_CHAINS
    with pytest.raises(SpecdeckError, match="cannot verify trees on MLX"):
        target.start().forward([3, 4, 5], n_logits=3, parents=[-1, 0, 0])


def test_gpt_oss_yarn_on_mlx_keeps_transformers_unrounded_range_at_gpt_oss_20bs_size():
    """gpt-oss-20b's rope (64-dim heads, 4096 original positions, truncate false): mlx-lm's
    rounded correction range moves its edge dimensions' frequencies, ours are transformers'."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = GptOssConfig(head_dim=64, rope_parameters=YARN_20B)
    inverse, _ = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    np.testing.assert_allclose(1.0 / np.array(yarn_periods(64, 150000.0, YARN_20B)),
                               inverse.numpy(), rtol=1e-6, atol=0)


def _edited_gpt_oss_logits_on_both(folder: Path, edit: dict) -> tuple[np.ndarray, np.ndarray]:
    """The tiny gpt-oss saved with its config.json edited, loaded from that one folder by
    transformers (eager) and by the MLX backend: both logits past the window."""
    import json

    from transformers import AutoModelForCausalLM

    from backends.mlx.backend import MlxBackend
    from tests.tiny import save_hf_folder

    folder = save_hf_folder(torch_model("gpt_oss"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | edit))
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    ids = [int(t) for t in np.arange(3 * WINDOW + 5) % 40 + 2]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    target = MlxBackend().load(str(folder), device="cpu", dtype="float32")
    return np.array(target.start().logits(ids, len(ids)).astype(mx.float32)), want


def test_gpt_oss_on_mlx_with_a_fractional_yarn_range_gives_transformers_logits(tmp_path):
    """256 original positions, where the tiny 8-dim heads' YaRN range is fractional (0.08 to
    1.24; mlx-lm's own rounding makes it 0 to 2 and misses by 1e-3)."""
    rope = torch_model("gpt_oss").hf.config.rope_parameters
    got, want = _edited_gpt_oss_logits_on_both(tmp_path / "gpt-oss", {
        "rope_parameters": rope | {"original_max_position_embeddings": 256},
        "max_position_embeddings": 256 * 32})  # YaRN's factor 32 over the original
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_gpt_oss_on_mlx_reads_its_configs_swiglu_slope_and_clamp(tmp_path):
    got, want = _edited_gpt_oss_logits_on_both(tmp_path / "gpt-oss", {
        "swiglu_alpha": 1.0, "swiglu_limit": 0.05})
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
