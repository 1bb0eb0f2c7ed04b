"""The suffix drafter in the engine: lossless (greedy and sampled) as a chain member ahead of a
draft model, a repeated request drafts from its history, and partitions never mix."""

from __future__ import annotations

import numpy as np
import pytest

from app.core.engine import SpecEngine
from app.core.types import SamplingParams
from app.drafters.chain import ChainDrafter
from app.drafters.suffix import SuffixDrafter
from app.store.history import LOCAL, History, HistoryStore, Record, partition_of
from backends import load_backend
from tests.distributions import assert_follows, second_token_law, second_tokens

pytest.importorskip("torch")

PROMPT = [5, 9, 12, 30, 17, 3, 7, 22, 41, 8]


@pytest.fixture
def history(tmp_path, monkeypatch) -> History:
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    return History(HistoryStore("tiny"))


def greedy(engine, drafter, k, n=30, prompt=PROMPT):
    return list(engine.generate(prompt, SamplingParams(max_new_tokens=n), drafter=drafter,
                                k=k))[-1]


@pytest.mark.parametrize("k", [1, 2, 4, 7, "auto"])
def test_greedy_output_with_the_suffix_member_equals_plain(target, unrelated, history, k):
    plain = greedy(SpecEngine(target), None, 0)
    history.record(LOCAL, PROMPT, plain.token_ids[:12])  # a partial earlier reply
    history.record(LOCAL, PROMPT[:4], [int(t) ^ 1 for t in plain.token_ids])  # a wrong one
    model = load_backend("torch").make_drafter("draft", target, draft=unrelated)
    for tree in (True, False):
        chain = ChainDrafter((SuffixDrafter(history, tree=tree, min_match=2), model))
        done = greedy(SpecEngine(target), chain, k)
        assert done.token_ids == plain.token_ids
        assert any(m.name.startswith("suffix:history") for m in done.stats.drafters)


@pytest.fixture(scope="module")
def varied():
    """A tiny model whose reply to VARIED repeats itself little (random tiny models soon
    cycle, which the request's own lookup drafts): what history adds shows."""
    from tests.tiny import tiny_llama

    model = tiny_llama(seed=1, hidden=64)
    model.eos_token_ids = frozenset()
    return model


VARIED = [41, 31, 25, 14, 16, 3, 5, 2, 10, 39]


def test_a_repeated_request_drafts_and_accepts_far_more_than_the_first(varied, history):
    engine, drafter = SpecEngine(varied), SuffixDrafter(history)
    first = greedy(engine, drafter, 4, n=40, prompt=VARIED)
    history.record(LOCAL, VARIED, first.token_ids)
    again = greedy(engine, drafter, 4, n=40, prompt=VARIED)
    assert again.token_ids == first.token_ids
    assert again.stats.accepted >= 0.7 * (len(again.token_ids) - 1)
    assert again.stats.accepted >= 2 * first.stats.accepted
    assert again.stats.target_forwards <= first.stats.target_forwards / 2


def test_one_partitions_replies_never_draft_another_partitions_tokens(target, history):
    engine = SpecEngine(target)
    alice, bob = partition_of("alice-key"), partition_of("bob-key")
    first = greedy(engine, SuffixDrafter(history, alice), 4, n=40)
    history.record(alice, PROMPT, first.token_ids)
    unseen = greedy(engine, SuffixDrafter(None), 4, n=40)
    seen_by_bob = greedy(engine, SuffixDrafter(history, bob), 4, n=40)
    assert history.index(bob).n_tokens == 0
    assert {m.name for m in seen_by_bob.stats.drafters} <= {"suffix:request"}
    assert seen_by_bob.stats.to_dict() | {"decode_tok_s": 0} | _times(seen_by_bob) == \
        unseen.stats.to_dict() | {"decode_tok_s": 0} | _times(unseen)
    assert greedy(engine, SuffixDrafter(history, alice), 4, n=40).stats.accepted > \
        seen_by_bob.stats.accepted


def _times(done) -> dict:
    """Timing fields set to 0: two runs' counts compare, their clocks do not."""
    return {k: 0 for k, v in done.stats.to_dict().items() if k.endswith("_s")} | \
        {"peak_memory_bytes": 0, "drafters": [
            {**d, "draft_s": 0} for d in done.stats.to_dict()["drafters"]]}


@pytest.mark.parametrize("tree", [True, False])
def test_sampled_output_with_the_suffix_cache_follows_the_target(history, tree):
    from tests.tiny import tiny_llama

    target = tiny_llama(seed=1)
    target.eos_token_ids = frozenset()  # every generation runs to its length
    prompt, n = [2, 3], 400
    rng = np.random.default_rng(0)
    # whatever the first token, the history has continuations of it, two ways, 2:1
    records = [Record((*prompt, t, *rng.integers(0, target.vocab_size, 3).tolist()))
               for t in range(target.vocab_size) for _ in (0, 1)]
    history.add(LOCAL, [*records, *records[::2]])
    drafter = SuffixDrafter(history, tree=tree)
    assert_follows(second_tokens(target, prompt, drafter, n), second_token_law(target, prompt)
                   * n)


@pytest.mark.parametrize("no_history", [False, True])
def test_every_finished_reply_plain_ones_too_is_recorded_unless_no_history(
        tmp_path, monkeypatch, no_history):
    from types import SimpleNamespace

    from app.loading import load_engine
    from app.store import history as store
    from tests.tiny import save_hf_folder, tiny_llama

    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path / "home"))
    folder = save_hf_folder(tiny_llama(seed=1), tmp_path / "tiny")
    loaded = load_engine(SimpleNamespace(target=str(folder), drafter="none", draft=None, k=0,
                                         backend="torch", device="cpu", dtype="float32",
                                         no_history=no_history))
    done = greedy(loaded.engine, None, None, n=6)
    assert (loaded.history is None) == no_history
    if no_history:
        assert store.stats() == []
        return
    loaded.history.flush()
    [kept] = store.stats()
    assert kept.partition == LOCAL and kept.tokens == len(PROMPT) + len(done.token_ids)


def test_the_workbench_records_chat_replies_and_one_click_clears_them(target, tmp_path):
    from app.store import history as store
    from app.ui.workbench import Workbench

    bench = Workbench()
    bench.attach(target)
    bound, _ = bench.engine("none", 4)
    greedy(bound.engine, bound.drafter, 0, n=5)
    assert "History is on" in bench.history_notice and bench.history.tokens(LOCAL) > 0
    bench.history.flush()
    assert "1 files removed" in bench.clear_history()
    assert store.stats() == [] and bench.history.tokens(LOCAL) == 0
    assert "off" in Workbench(history=False).history_notice


class Offering(SuffixDrafter):
    """The suffix drafter, keeping what it offered the k controller each time it was asked."""

    offered: list[tuple[int, ...]] = []

    def propose(self, context, k):
        draft = super().propose(context, k)
        self.offered.append(draft.tokens)
        return draft


def test_an_exact_repeat_under_k_auto_offers_drafts_deeper_than_the_controllers_k_max(
        varied, history):
    # what the controller then verifies depends on measured verify costs: here only the offer
    engine, drafter = SpecEngine(varied, k_max=8), Offering(history, tree=False)
    first = greedy(engine, drafter, "auto", n=60, prompt=VARIED)
    history.record(LOCAL, VARIED, first.token_ids)
    drafter.offered = []
    again = greedy(engine, drafter, "auto", n=60, prompt=VARIED)
    assert again.token_ids == first.token_ids
    reply = list(first.token_ids)
    assert any(len(tokens) > 8 and tokens == tuple(reply[i:i + len(tokens)])
               for tokens in drafter.offered for i in range(len(reply)))
