"""DFlash 2 block drafters: a tiny random DFlash 2 drafter (convolutions around each sublayer,
a candidate selector; codebooks stored without `.weight`) proposes, round by round, the blocks
the reference implementation (PyPI dflash 0.1.0, golden values made by
tests/fixtures/dflash/make_golden2.py) proposed, and its selector's q is the reference's;
speculative output equals plain decoding
(greedy at k 1, 2, 4, 7; sampled output keeps the target's law through the selector's q);
incomplete DFlash 2 folders are refused naming what they lack."""

from __future__ import annotations

import json
import shutil
import time
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
from backends.torch.heads.dflash import load_dflash_drafter  # noqa: E402
from tests.distributions import assert_follows  # noqa: E402
from tests.marks import heavy  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "dflash"
DRAFTER = FIX / "drafter2"
GOLDEN = json.loads((FIX / "golden2.json").read_text())


@pytest.fixture(scope="module")
def target():
    return TorchBackend().load(str(FIX / "target"), device="cpu", dtype="float32")


class Recording:
    """The drafter, with every proposed block and its wall time kept."""

    def __init__(self, inner):
        self.inner, self.blocks, self.seconds = inner, [], []
        self.name, self.capture_layers = inner.name, inner.capture_layers

    def begin(self, *args):
        self.inner.begin(*args)

    def propose(self, context, k):
        began = time.perf_counter()
        draft = self.inner.propose(context, k)
        self.seconds.append(time.perf_counter() - began)
        self.blocks.append(list(draft.tokens))
        return draft

    def accept(self, feed):
        self.inner.accept(feed)


def test_each_round_drafts_the_block_the_reference_drafted(target):
    drafter = Recording(build_drafter("dflash", target, backend=TorchBackend(),
                                      head=str(DRAFTER)))
    events = list(SpecEngine(target).generate(GOLDEN["prompt"], SamplingParams(
        max_new_tokens=24), drafter=drafter, k=3))
    done = events[-1]
    assert list(GOLDEN["prompt"]) + list(done.token_ids) == GOLDEN["output_ids"]
    steps = [e for e in events if isinstance(e, Step)][1:]  # after the prefill's token
    # near the end the engine caps k by the tokens left (a shorter block attends otherwise);
    # the reference keeps whole blocks: compare the rounds before the first cut
    rounds = next(i for i, block in enumerate(drafter.blocks) if len(block) < 3)
    assert rounds >= 15 and 2 in GOLDEN["acceptance_lengths"][:rounds]  # accepted rows read
    assert [len(s.tokens) for s in steps][:rounds] == GOLDEN["acceptance_lengths"][:rounds]
    assert drafter.blocks[:rounds] == GOLDEN["drafts"][:rounds]


@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_greedy_dflash_2_gives_exactly_the_plain_tokens(target, k):
    prompt = GOLDEN["prompt"]
    plain = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=30)))[-1]
    drafter = load_dflash_drafter(target, str(DRAFTER))
    done = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=30),
                                            drafter=drafter, k=k))[-1]
    assert done.token_ids == plain.token_ids
    assert 0 < done.stats.drafted <= min(k, 3) * done.stats.target_forwards  # block 4: k <= 3


def test_sampled_drafts_come_with_the_selectors_q_over_its_candidates(target):
    drafter = load_dflash_drafter(target, str(DRAFTER))
    prompt = GOLDEN["prompt"]
    done = list(SpecEngine(target).generate(prompt, SamplingParams(
        temperature=1.0, max_new_tokens=2, seed=0), drafter=drafter, k=3))[-1]
    draft = drafter.propose([*prompt, *done.token_ids], 3)
    assert draft.probs.shape == (3, target.vocab_size)
    assert np.allclose(draft.probs.sum(-1), 1.0)
    assert all((row > 0).sum() <= 8 and row[t] > 0 for row, t in zip(draft.probs, draft.tokens))


def test_the_first_slots_q_is_the_references(target):
    golden = GOLDEN["sampled_first_slot"]
    drafter = load_dflash_drafter(target, str(DRAFTER))
    prompt, anchor = GOLDEN["prompt"], golden["anchor"]
    out = target.start().forward(prompt, capture=drafter.capture_layers)
    drafter.begin(prompt, StepFeed.prompt(prompt, out, anchor), SamplingParams(temperature=1.0),
                  np.random.default_rng(0))
    q = drafter.propose([*prompt, anchor], 3).probs[0]
    assert set(np.flatnonzero(q)) <= set(golden["candidates"])
    assert np.allclose(q[golden["candidates"]], golden["q"], rtol=1e-4, atol=1e-7)


@pytest.mark.heavy  # 500 sampled generations
def test_sampled_dflash_2_commits_tokens_from_the_targets_own_distribution():
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
    drafter = load_dflash_drafter(target, str(DRAFTER))
    for seed in range(n):
        done = list(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3,
                                                           seed=seed), drafter=drafter, k=2))[-1]
        counts[done.token_ids[1]] += 1
    assert done.stats.drafted > 0
    assert_follows(counts, expected * n)


def test_a_dflash_2_folder_missing_a_selector_tensor_is_refused_naming_it(target, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "d2"
    shutil.copytree(DRAFTER, folder)
    state = load_file(str(folder / "model.safetensors"))
    del state["candidate_selector.successor_codebook"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(SpecdeckError, match="DFlash 2 drafter without the tensors "
                                            r"\['candidate_selector.successor_codebook'\]"):
        load_dflash_drafter(target, str(folder))


def test_a_dflash_2_config_without_its_selector_keys_is_refused_naming_them(target, tmp_path):
    folder = tmp_path / "d2"
    shutil.copytree(DRAFTER, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["dflash_config"]["selector_top_k"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdeckError, match="dflash_config lacks selector_top_k"):
        load_dflash_drafter(target, str(folder))


def test_codebooks_saved_with_weight_suffixes_load_too(target, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "d2"
    shutil.copytree(DRAFTER, folder)
    state = load_file(str(folder / "model.safetensors"))
    state = {k + ".weight" if k.endswith("_codebook") else k: v for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"))
    assert load_dflash_drafter(target, str(folder)).model.candidate_selector is not None
