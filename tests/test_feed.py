"""The step record (StepFeed) the engine hands a drafter: which verify rows it kept, their
tokens and positions, the next token, and the captured states of exactly those rows."""

from __future__ import annotations

import numpy as np
import pytest

from app.core.engine import SpecEngine
from app.core.feed import StepFeed
from app.core.protocols import TargetOutput
from app.core.types import Draft, SamplingParams, Verdict
from tests.fakes import FakeModel

LAYER = 3


def verified(rows: int) -> TargetOutput:
    """A verify forward whose captured row i holds [i, i] (so a taken row names itself)."""
    states = np.repeat(np.arange(rows, dtype=np.float32)[:, None], 2, axis=1)
    return TargetOutput(argmax=tuple(range(100, 100 + rows)), hidden_states={LAYER: states})


def test_the_step_record_names_the_rows_the_verify_kept_for_a_tree_path():
    # the root's children 3 and 5; 5's children 6 and 1: the target took 5 then 6, then 2
    draft = Draft(tokens=(3, 5, 6, 1), parents=(-1, -1, 1, 1))
    verdict = Verdict(path=(1, 2), next_token=2, is_bonus=True)
    feed = StepFeed.verify(9, 40, draft, verdict, verified(5))
    assert feed.rows == (0, 2, 3)  # the pending token's row, then 1 + each path node
    assert feed.tokens == (9, 5, 6)
    assert feed.positions == range(40, 43) and feed.end == 43
    assert feed.following == (5, 6, 2)  # per row, the token after it
    assert feed.hidden_states[LAYER][:, 0].tolist() == [0, 2, 3]
    assert feed.argmax == (100, 101, 102, 103, 104)  # every row's, the dropped ones too


def test_after_a_rejection_the_record_ends_at_the_recovered_token():
    draft = Draft(tokens=(4, 6, 8))
    verdict = Verdict(path=(0,), next_token=7, is_bonus=False)
    out = verified(4)
    feed = StepFeed.verify(9, 40, draft, verdict, out)
    assert (feed.tokens, feed.rows, feed.next_token) == ((9, 4), (0, 1), 7)
    assert feed.positions == range(40, 42) and feed.end == 42  # 7 sits at 42, not yet read
    states = feed.hidden_states[LAYER]
    assert states[:, 0].tolist() == [0, 1]
    assert np.shares_memory(states, out.hidden_states[LAYER])  # a chain's rows: a view


def test_after_a_bonus_token_the_record_holds_every_draft_and_ends_at_the_bonus():
    draft = Draft(tokens=(4, 6, 8))
    feed = StepFeed.verify(9, 40, draft, Verdict(path=(0, 1, 2), next_token=5, is_bonus=True),
                           verified(4))
    assert feed.rows == (0, 1, 2, 3) and feed.tokens == (9, 4, 6, 8)
    assert feed.end == 44 and feed.following == (4, 6, 8, 5)


def test_the_prompt_record_starts_after_the_reused_prefix_and_ends_at_the_first_token():
    prompt = [5, 6, 7, 8, 9]
    feed = StepFeed.prompt(prompt, verified(3), next_token=11, start=2)
    assert feed.tokens == (7, 8, 9) and feed.rows == (0, 1, 2)
    assert feed.positions == range(2, 5) and feed.following == (8, 9, 11)
    later = feed.since(4)  # a drafter already holding positions 2 and 3
    assert (later.tokens, later.rows, later.start, later.next_token) == ((9,), (2,), 4, 11)
    assert later.hidden_states[LAYER][:, 0].tolist() == [2]
    assert feed.since(0) is feed


def test_a_record_without_rows_is_refused():
    with pytest.raises(ValueError):
        StepFeed(tokens=(1, 2), start=0, rows=(0,), next_token=3)


class Recording:
    """Knows the target's continuation: drafts a tree whose every depth has a wrong first
    child and the right second one (so a path skips rows); keeps every feed it is handed."""

    name, capture_layers = "recording", ()

    def __init__(self, truth: list[int], vocab: int) -> None:
        self.truth, self.vocab = truth, vocab
        self.feeds: list[StepFeed] = []

    def begin(self, prompt_ids, feed, params, rng) -> None:
        self.feeds = [feed]

    def propose(self, context, k: int) -> Draft:
        if list(context) != self.truth[:len(context)]:
            return Draft()
        tokens, parents = [], []
        for token in self.truth[len(context):len(context) + k]:
            parent = len(tokens) - 1  # the previous depth's right child
            tokens += [(token + 1) % self.vocab, token]
            parents += [parent, parent]
        return Draft(tokens=tuple(tokens), parents=tuple(parents))

    def accept(self, feed: StepFeed) -> None:
        self.feeds.append(feed)


@pytest.mark.parametrize("k", [1, 4])
def test_every_feed_starts_where_the_last_ended_and_reads_the_committed_context(k):
    model, prompt = FakeModel(vocab=6, seed=2), [0, 1, 2, 0, 1, 2, 0, 1]
    plain = list(SpecEngine(model).generate(prompt, SamplingParams(max_new_tokens=30)))[-1]
    truth = prompt + list(plain.token_ids)
    drafter = Recording(truth, 6)
    engine = SpecEngine(model, drafter, k=k)
    list(engine.generate(prompt[:3], SamplingParams(max_new_tokens=4)))  # a cached prefix
    done = list(engine.generate(prompt, SamplingParams(max_new_tokens=30)))[-1]
    feeds = drafter.feeds
    # the prefix the session reused is not fed again
    assert feeds[0].start == done.stats.n_cached_prompt_tokens > 0
    assert done.token_ids == plain.token_ids and len(feeds) == done.stats.target_forwards + 1
    assert any(feed.rows[1:2] == (2,) for feed in feeds)  # a path past a wrong sibling
    for before, after in zip(feeds, feeds[1:]):
        assert after.start == before.end and after.tokens[0] == before.next_token
    for feed in feeds:
        assert list(feed.tokens) == truth[feed.start:feed.end]
        assert feed.next_token == truth[feed.end]
