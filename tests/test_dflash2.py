"""DFlash 2 block drafters, on torch and MLX: a tiny random DFlash 2 drafter (convolutions
around each sublayer, a candidate selector; codebooks stored without `.weight`) proposes,
round by round, the blocks the reference implementation (PyPI dflash 0.1.0, golden values made
by tests/fixtures/dflash/make_golden2.py with its torch code and make_golden_mlx.py with its
MLX code) proposed, and its selector's q is the reference's;
its sampled drafts carry the selector's q (greedy and sampled losslessness: test_dflash.py,
over both drafter folders); incomplete DFlash 2 folders are refused naming what they lack."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from app.core.engine import SpecEngine  # noqa: E402
from app.core.feed import StepFeed  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError, Step  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from backends.torch.head_weights.dflash import load_dflash_drafter  # noqa: E402
from tests.fakes import RecordingDrafter  # noqa: E402
from tests.test_dflash import BACKENDS, GOLDEN_MLX, dflash, each_backend  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "dflash"
DRAFTER = FIX / "drafter2"
GOLDEN = json.loads((FIX / "golden2.json").read_text())


on = pytest.fixture(scope="module", params=BACKENDS, name="on")(each_backend)


@pytest.fixture(scope="module")
def target():
    return TorchBackend().load(str(FIX / "target"), device="cpu", dtype="float32")


def test_each_round_drafts_the_block_the_reference_drafted(on):
    backend, target = on
    drafter = RecordingDrafter(build_drafter("dflash", target, backend=backend, head=str(DRAFTER)))
    events = list(SpecEngine(target).generate(GOLDEN["prompt"], SamplingParams(
        max_new_tokens=24), drafter=drafter, k=3))
    done = events[-1]
    # the reference's torch code (golden2.json) on torch, its MLX code on MLX
    golden = GOLDEN if backend.name == "torch" else GOLDEN_MLX["drafter2"]
    assert list(GOLDEN["prompt"]) + list(done.token_ids) == golden["output_ids"]
    steps = [e for e in events if isinstance(e, Step)][1:]  # after the prefill's token
    # near the end the engine caps k by the tokens left (a shorter block attends otherwise);
    # the reference keeps whole blocks: compare the rounds before the first cut
    rounds = next(i for i, block in enumerate(drafter.blocks) if len(block) < 3)
    assert rounds >= 15 and 2 in GOLDEN["acceptance_lengths"][:rounds]  # accepted rows read
    assert [len(s.tokens) for s in steps][:rounds] == GOLDEN["acceptance_lengths"][:rounds]
    assert drafter.blocks[:rounds] == golden["drafts"][:rounds]


def test_sampled_drafts_come_with_the_selectors_q_over_its_candidates(on):
    _, target = on
    drafter = dflash(on, "drafter2")
    prompt = GOLDEN["prompt"]
    done = list(SpecEngine(target).generate(prompt, SamplingParams(
        temperature=1.0, max_new_tokens=2, seed=0), drafter=drafter, k=3))[-1]
    draft = drafter.propose([*prompt, *done.token_ids], 3)
    assert draft.probs.shape == (3, target.vocab_size)
    assert np.allclose(draft.probs.sum(-1), 1.0)
    assert all((row > 0).sum() <= 8 and row[t] > 0 for row, t in zip(draft.probs, draft.tokens))


def test_the_first_slots_q_is_the_references(on):
    _, target = on
    golden = GOLDEN["sampled_first_slot"]
    drafter = dflash(on, "drafter2")
    prompt, anchor = GOLDEN["prompt"], golden["anchor"]
    out = target.start().forward(prompt, capture=drafter.capture_layers)
    drafter.begin(prompt, StepFeed.prompt(prompt, out, anchor), SamplingParams(temperature=1.0),
                  np.random.default_rng(0))
    q = drafter.propose([*prompt, anchor], 3).probs[0]
    assert set(np.flatnonzero(q)) <= set(golden["candidates"])
    assert np.allclose(q[golden["candidates"]], golden["q"], rtol=1e-4, atol=1e-7)


def test_a_dflash_2_folder_missing_a_selector_tensor_is_refused_naming_it(on, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "d2"
    shutil.copytree(DRAFTER, folder)
    state = load_file(str(folder / "model.safetensors"))
    del state["candidate_selector.successor_codebook"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(SpecdeckError, match="DFlash 2 drafter without the tensors "
                                            r"\['candidate_selector.successor_codebook'\]"):
        dflash(on, folder)


def test_a_dflash_2_config_without_its_selector_keys_is_refused_naming_them(target, tmp_path):
    folder = tmp_path / "d2"
    shutil.copytree(DRAFTER, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["dflash_config"]["selector_top_k"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdeckError, match="dflash_config lacks selector_top_k"):
        load_dflash_drafter(target, str(folder))


def test_codebooks_saved_with_weight_suffixes_load_too(on, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "d2"
    shutil.copytree(DRAFTER, folder)
    state = load_file(str(folder / "model.safetensors"))
    state = {k + ".weight" if k.endswith("_codebook") else k: v for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"))
    assert dflash(on, folder).model.candidate_selector is not None
