"""DFlash block drafters: a tiny random drafter in the z-lab layout proposes, round by round,
the blocks the reference implementation (PyPI dflash, golden values made by
tests/fixtures/dflash/make_golden.py) proposed; speculative output equals plain decoding
(greedy oracle at k 1, 2, 4, 7, k capped by the block size; sampled output keeps the target's
law; for DFlash, DFlash 2 and DSpark); drafters it cannot run are refused naming why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from app.core.engine import SpecEngine  # noqa: E402
from app.core.feed import StepFeed  # noqa: E402
from app.core.sampling import warp  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError, Step  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from backends.torch.heads.dflash import default_layer_ids, load_dflash_drafter  # noqa: E402
from tests.distributions import assert_follows  # noqa: E402
from tests.marks import heavy  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "dflash"
GOLDEN = json.loads((FIX / "golden.json").read_text())
# the block drafters the oracle tests run: DFlash, DFlash 2 (its own tests: test_dflash2.py)
# and DSpark (tests/test_dspark.py)
BLOCK_DRAFTERS = {"dflash": FIX / "drafter", "dflash2": FIX / "drafter2",
                  "dspark": FIX.parent / "dspark" / "drafter"}


def block_drafter(target, name):
    kind = "dspark" if name == "dspark" else "dflash"
    return build_drafter(kind, target, backend=TorchBackend(), head=str(BLOCK_DRAFTERS[name]))


@pytest.fixture(scope="module")
def target():
    return TorchBackend().load(str(FIX / "target"), device="cpu", dtype="float32")


class Recording:
    """The drafter, with every proposed block kept."""

    def __init__(self, inner):
        self.inner, self.blocks = inner, []
        self.name, self.capture_layers = inner.name, inner.capture_layers

    def begin(self, *args):
        self.inner.begin(*args)

    def propose(self, context, k):
        draft = self.inner.propose(context, k)
        self.blocks.append(list(draft.tokens))
        return draft

    def accept(self, feed):
        self.inner.accept(feed)


def test_each_round_drafts_the_block_the_reference_drafted(target):
    drafter = Recording(build_drafter("dflash", target, backend=TorchBackend(),
                                      head=str(FIX / "drafter")))
    events = list(SpecEngine(target).generate(GOLDEN["prompt"], SamplingParams(
        max_new_tokens=24), drafter=drafter, k=3))
    done = events[-1]
    assert list(GOLDEN["prompt"]) + list(done.token_ids) == GOLDEN["output_ids"]
    steps = [e for e in events if isinstance(e, Step)][1:]  # after the prefill's token
    assert [len(s.tokens) for s in steps][:20] == GOLDEN["acceptance_lengths"][:20]
    assert drafter.blocks[:20] == GOLDEN["drafts"][:20]  # rounds with whole blocks



def test_after_a_reused_prompt_prefix_the_cache_keeps_the_context_it_read_and_no_block(target):
    drafter = build_drafter("dflash", target, backend=TorchBackend(), head=str(FIX / "drafter"))
    prompt, reused = list(GOLDEN["prompt"]), 2
    session = target.start()
    session.forward(prompt[:reused])  # the prefix a previous reply left in the target's cache
    out = session.forward(prompt[reused:], capture=drafter.capture_layers)
    drafter.begin(prompt, StepFeed.prompt(prompt, out, 7, start=reused), SamplingParams(), None)
    assert len(drafter.propose([*prompt, 7], 3).tokens) == 3
    assert all(key.shape[1] == len(prompt) - reused for key, _ in drafter._cache)

@pytest.mark.parametrize("name", BLOCK_DRAFTERS)
@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_greedy_block_drafters_give_exactly_the_oracles_tokens(target, k, name):
    prompt = GOLDEN["prompt"]
    plain = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=30)))[-1]
    drafter = block_drafter(target, name)
    done = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=30),
                                            drafter=drafter, k=k))[-1]
    assert done.token_ids == plain.token_ids
    # block 4: DFlash drafts k <= 3, DSpark (row j: anchor + j + 1) k <= 4
    assert 0 < done.stats.drafted <= min(k, drafter.max_drafts) * done.stats.target_forwards


@pytest.mark.heavy  # 500 sampled generations
@pytest.mark.parametrize("name", BLOCK_DRAFTERS)
def test_sampled_block_drafters_commit_tokens_from_the_targets_own_distribution(name):
    target = TorchBackend().load(str(FIX / "target"), device="cpu", dtype="float32")
    target.eos_token_ids = frozenset()  # every generation runs to its length
    params = SamplingParams(temperature=1.0)
    prompt = [2, 3]
    session = target.start()  # the target's law of the second token (the first is sampled
    p0 = warp(session.forward(prompt).host_logits()[-1].astype(np.float64), params)
    expected = np.zeros(target.vocab_size)  # at the prefill; the second is verified)
    for a in range(target.vocab_size):
        expected += p0[a] * warp(session.forward([a]).host_logits()[-1].astype(np.float64),
                                 params)
        session.rewind(len(prompt))
    engine, n = SpecEngine(target), 500
    counts = np.zeros(target.vocab_size)
    drafter = block_drafter(target, name)  # begin() resets it per call
    for seed in range(n):
        done = list(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3,
                                                           seed=seed), drafter=drafter, k=2))[-1]
        counts[done.token_ids[1]] += 1
    assert done.stats.drafted > 0
    assert_follows(counts, expected * n)


def test_the_default_target_layers_follow_the_reference_rule():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab Qwen3-8B-DFlash-b16
    assert default_layer_ids(4, 1) == [2]


def test_a_folder_labelled_dflash_2_without_its_config_keys_is_refused_naming_them(target,
                                                                                  tmp_path):
    folder = tmp_path / "d2"
    shutil.copytree(FIX / "drafter", folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["DFlash2DraftModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdeckError, match="DFlash 2 drafter whose dflash_config lacks"):
        load_dflash_drafter(target, str(folder))


def test_a_drafter_for_another_target_is_refused(target, tmp_path):
    folder = tmp_path / "other"
    shutil.copytree(FIX / "drafter", folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 9]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdeckError, match=r"target_layer_ids \[9\] are outside"):
        load_dflash_drafter(target, str(folder))


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
