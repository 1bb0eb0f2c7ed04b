"""DFlash block drafters, on torch and on MLX (its CPU build here): a tiny random drafter in
the z-lab layout proposes, round by round, the blocks the reference implementation proposed
(PyPI dflash; golden values made by tests/fixtures/dflash/make_golden.py with its torch code,
make_golden_mlx.py with its MLX code); both backends draft the same blocks; speculative output
equals plain decoding (greedy oracle at k 1, 2, 4, 7, k capped by the block size; sampled
output keeps the target's law; both for DFlash and DFlash 2); drafters it cannot run are
refused naming why."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from app.core.engine import SpecEngine  # noqa: E402
from app.core.feed import StepFeed  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError, Step  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends import load_backend  # noqa: E402
from backends.heads.dflash_format import default_layer_ids  # noqa: E402
from tests.distributions import assert_follows, second_token_law, second_tokens  # noqa: E402
from tests.fakes import RecordingDrafter  # noqa: E402
from tests.marks import heavy  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "dflash"
GOLDEN = json.loads((FIX / "golden.json").read_text())
GOLDEN_MLX = json.loads((FIX / "golden_mlx.json").read_text())  # per drafter folder
DRAFTERS = ("drafter", "drafter2")  # DFlash and DFlash 2 (its own tests: test_dflash2.py)
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                               reason="mlx-lm is not installed")
MLX = pytest.param("mlx", marks=needs_mlx)
BACKENDS = ("torch", MLX)


def load_target(name: str):
    return load_backend(name).load(str(FIX / "target"), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def target():
    return load_target("torch")


@pytest.fixture(scope="module")
def mlx_target():
    return load_target("mlx")


def each_backend(request):
    """(backend, its target) for each backend; drafters are built with `dflash(on, folder)`."""
    return load_backend(request.param), load_target(request.param)


on = pytest.fixture(scope="module", params=BACKENDS, name="on")(each_backend)


def dflash(on, folder: str | Path = "drafter"):
    """The drafter of a fixture folder (or of any folder, given its path) on `on`'s target."""
    backend, target = on
    return backend.make_drafter("dflash", target, head=str(FIX / folder))


def test_each_round_drafts_the_block_the_reference_drafted(on):
    backend, target = on
    drafter = RecordingDrafter(build_drafter("dflash", target, backend=backend,
                                      head=str(FIX / "drafter")))
    events = list(SpecEngine(target).generate(GOLDEN["prompt"], SamplingParams(
        max_new_tokens=24), drafter=drafter, k=3))
    done = events[-1]
    # the reference's torch code (golden.json) on torch, its MLX code on MLX
    golden = GOLDEN if backend.name == "torch" else GOLDEN_MLX["drafter"]
    assert list(GOLDEN["prompt"]) + list(done.token_ids) == golden["output_ids"]
    steps = [e for e in events if isinstance(e, Step)][1:]  # after the prefill's token
    assert [len(s.tokens) for s in steps][:20] == GOLDEN["acceptance_lengths"][:20]
    assert drafter.blocks[:20] == golden["drafts"][:20]  # rounds with whole blocks


@needs_mlx
@pytest.mark.parametrize("folder", DRAFTERS)
def test_mlx_drafts_the_blocks_torch_drafts_and_commits_the_same_tokens(target, mlx_target,
                                                                       folder):
    runs = {}
    for name, model in (("torch", target), ("mlx", mlx_target)):
        drafter = RecordingDrafter(load_backend(name).make_drafter("dflash", model,
                                                             head=str(FIX / folder)))
        done = list(SpecEngine(model).generate(GOLDEN["prompt"], SamplingParams(
            max_new_tokens=20), drafter=drafter, k=3))[-1]
        runs[name] = (done.token_ids, drafter.blocks)
    assert runs["mlx"] == runs["torch"]


def test_after_a_reused_prompt_prefix_the_cache_keeps_the_context_it_read_and_no_block(on):
    _, target = on
    drafter = dflash(on)
    prompt, reused = list(GOLDEN["prompt"]), 2
    session = target.start()
    session.forward(prompt[:reused])  # the prefix a previous reply left in the target's cache
    out = session.forward(prompt[reused:], capture=drafter.capture_layers)
    drafter.begin(prompt, StepFeed.prompt(prompt, out, 7, start=reused), SamplingParams(), None)
    assert len(drafter.propose([*prompt, 7], 3).tokens) == 3
    assert all(key.shape[1] == len(prompt) - reused for key, _ in drafter._cache)


@pytest.mark.parametrize("folder", DRAFTERS)
@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_greedy_dflash_gives_exactly_the_oracles_tokens(on, k, folder):
    _, target = on
    prompt = GOLDEN["prompt"]
    plain = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=30)))[-1]
    drafter = dflash(on, folder)
    done = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=30),
                                            drafter=drafter, k=k))[-1]
    assert done.token_ids == plain.token_ids
    assert 0 < done.stats.drafted <= min(k, 3) * done.stats.target_forwards  # block 4: k <= 3


@pytest.mark.heavy  # 500 sampled generations
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("folder", DRAFTERS)
def test_sampled_dflash_commits_tokens_from_the_targets_own_distribution(folder, backend):
    target = load_target(backend)
    target.eos_token_ids = frozenset()  # every generation runs to its length
    prompt, n = [2, 3], 500
    expected = second_token_law(target, prompt)
    drafter = load_backend(backend).make_drafter("dflash", target, head=str(FIX / folder))
    assert_follows(second_tokens(target, prompt, drafter, n), expected * n)


def test_the_default_target_layers_follow_the_reference_rule():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab Qwen3-8B-DFlash-b16
    assert default_layer_ids(4, 1) == [2]


def test_a_folder_labelled_dflash_2_without_its_config_keys_is_refused_naming_them(on,
                                                                                  tmp_path):
    folder = tmp_path / "d2"
    shutil.copytree(FIX / "drafter", folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["DFlash2DraftModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdeckError, match="DFlash 2 drafter whose dflash_config lacks"):
        dflash(on, folder)


def test_a_drafter_for_another_target_is_refused(on, tmp_path):
    folder = tmp_path / "other"
    shutil.copytree(FIX / "drafter", folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 9]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdeckError, match=r"target_layer_ids \[9\] are outside"):
        dflash(on, folder)


def test_the_ui_workbench_runs_a_pair_whose_drafter_is_a_head_folder():
    from app.ui.workbench import Choice, Workbench

    bench = Workbench(backend="torch", device="cpu")
    bench.load(str(FIX / "target"), head=str(FIX / "drafter"),
               auto_kind=Choice("dflash", "auto: the pair's drafter"))
    assert bench.draft is None  # a head folder is never loaded as a causal LM
    bound, choice = bench.engine("auto", 3)
    assert choice.kind == "dflash" and bound.drafter.name == "dflash"
    prompt = GOLDEN["prompt"]
    done = list(bound.engine.generate(prompt, SamplingParams(max_new_tokens=12),
                                      drafter=bound.drafter, k=bound.k))[-1]
    assert list(prompt) + list(done.token_ids) == GOLDEN["output_ids"][:len(prompt) + 12]
    bench.unload()
    with pytest.raises(SpecdeckError, match="needs its head"):
        Workbench(backend="torch", device="cpu").resolve("dflash")
