"""Tree drafts: verification follows the target's own choice down any branch, sampled tree
verification keeps the target's distribution, and a tree forward kept to one path leaves the
cache bit for bit where a chain forward of that path would."""

from __future__ import annotations

import numpy as np
import pytest

from app.core.engine import SpecEngine
from app.core.sampling import warp
from app.core.types import Draft, SamplingParams
from app.core.verify import verify_greedy, verify_sampled
from tests.distributions import assert_follows
from tests.fakes import FakeModel

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]


class ScriptedTreeDrafter:
    """Knows the oracle's continuation; hides it at a random sibling of each depth among
    distractors (and, now and then, leaves it out), within a node budget."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, oracle: list[int], vocab: int, seed: int, max_nodes: int = 16,
                 miss: float = 0.15) -> None:
        self.oracle, self.vocab, self.max_nodes, self.miss = oracle, vocab, max_nodes, miss
        self.rng = np.random.default_rng(seed)
        self.name = "scripted-tree"

    def begin(self, *args: object) -> None:
        return None

    def propose(self, context, k):
        truth = self.oracle[len(context):len(context) + k]
        tokens: list[int] = []
        parents: list[int] = []
        at = -1
        for token in truth:
            width = int(self.rng.integers(1, 4))
            siblings = [int(t) for t in self.rng.choice(
                [t for t in range(self.vocab) if t != token], size=width, replace=False)]
            if self.rng.random() > self.miss:
                siblings[int(self.rng.integers(width))] = token
            if len(tokens) + width > self.max_nodes:
                break
            for sibling in siblings:
                parents.append(at)
                tokens.append(sibling)
            if token not in siblings:
                break
            at = len(tokens) - width + siblings.index(token)
        return Draft(tokens=tuple(tokens), parents=tuple(parents))

    def accept(self, feed) -> None:
        return None


def oracle(target, n: int = 40, prompt: list[int] = PROMPT) -> list[int]:
    done = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=n)))[-1]
    return prompt + list(done.token_ids)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tree_hiding_the_truth_at_random_siblings_gives_exactly_the_oracles_tokens(
        target, k, seed):
    truth = oracle(target)
    drafter = ScriptedTreeDrafter(truth, target.vocab_size, seed)
    done = list(SpecEngine(target, drafter, k=k).generate(
        PROMPT, SamplingParams(max_new_tokens=40)))[-1]
    assert PROMPT + list(done.token_ids) == truth
    assert done.stats.accepted > 0


@pytest.mark.parametrize("k", [1, 4, 7])
def test_on_the_numpy_fake_a_scripted_tree_also_gives_the_oracles_tokens(k):
    model, prompt = FakeModel(vocab=12, seed=k), [0, 3, 5]
    truth = oracle(model, 30, prompt)
    done = list(SpecEngine(model, ScriptedTreeDrafter(truth, 12, k), k=k).generate(
        prompt, SamplingParams(max_new_tokens=30)))[-1]
    assert prompt + list(done.token_ids) == truth


def test_greedy_tree_verification_takes_the_branch_the_target_chose():
    # root children 3 and 5; 5 has child 6; the target says 5 then 6 then 2
    draft = Draft(tokens=(3, 5, 6, 1), parents=(-1, -1, 1, 1))
    verdict = verify_greedy(draft, (5, 0, 6, 2, 0))
    assert (verdict.path, verdict.next_token, verdict.is_bonus) == ((1, 2), 2, True)


def test_a_tree_cut_to_depth_keeps_whole_branches_and_its_first_chain_is_a_chain():
    draft = Draft(tokens=(3, 5, 6, 1, 7), parents=(-1, -1, 1, 1, 2))
    assert draft.within(2) == Draft(tokens=(3, 5, 6, 1), parents=(-1, -1, 1, 1))
    assert draft.first_chain() == Draft(tokens=(3,))
    assert Draft(tokens=(4, 6, 8), parents=(-1, 0, 1)).is_tree is False


# ---------------------------------------------------------------- sampled trees


VOCAB = 4


class SampledTreeDrafter:
    """Two children per node, two deep, drawn from q = softmax(Q[parent token])."""

    capture_layers: tuple[int, ...] = ()
    name = "sampled-tree"

    def __init__(self, q_table: np.ndarray, mode: str, rng: np.random.Generator) -> None:
        self.q_table, self.mode, self.rng = q_table, mode, rng

    def begin(self, *args: object) -> None:
        return None

    def propose(self, context, k):
        tokens, parents, rows = [], [], []
        frontier = [(-1, context[-1])]
        for _depth in range(min(k, 2)):
            nxt = []
            for parent, last in frontier:
                for token, q in self._children(last):
                    parents.append(parent)
                    tokens.append(token)
                    rows.append(q)
                    nxt.append((len(tokens) - 1, token))
            frontier = nxt[:2]
        return Draft(tokens=tuple(tokens), parents=tuple(parents), probs=np.stack(rows))

    def _children(self, last: int):
        q = self.q_table[last].copy()
        out = []
        for _ in range(2):
            if self.mode == "deterministic":
                token = int(np.argsort(q)[-1])
                out.append((token, np.eye(VOCAB)[token]))
                q[token] = 0.0
                continue
            token = int(self.rng.choice(VOCAB, p=q / q.sum()))
            out.append((token, q / q.sum()))
            if self.mode == "distinct":  # without replacement: q renormalised without it
                q = q.copy()
                q[token] = 0.0
        return out

    def accept(self, feed) -> None:
        return None


@pytest.mark.parametrize("mode", ["deterministic", "iid", "distinct"])
def test_sampled_tree_verification_commits_tokens_from_the_targets_own_distribution(mode):
    rng = np.random.default_rng(7)
    model = FakeModel(vocab=VOCAB, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    p = warp(model.table.astype(np.float64), params)  # p[t]: the target's next-token law after t
    q = warp(rng.normal(0, 2, (VOCAB, VOCAB)), params)  # an unrelated draft law
    engine = SpecEngine(model)
    counts = np.zeros((VOCAB, VOCAB, VOCAB))
    n = 6000
    for seed in range(n):
        drafter = SampledTreeDrafter(q, mode, np.random.default_rng(seed + 10_000))
        done = list(engine.generate([0], SamplingParams(temperature=1.0, max_new_tokens=3,
                                                        seed=seed), drafter=drafter, k=2))[-1]
        counts[tuple(done.token_ids[:3])] += 1
    expected = p[0][:, None, None] * p[:, :, None] * p[None, :, :]
    expected = expected.ravel() * n
    observed = counts.ravel()
    assert_follows(observed, expected)
    assert 0.5 * np.abs(observed / n - expected / n).sum() < 0.05


def test_recursive_rejection_never_recovers_a_token_its_rejected_siblings_took_from_p():
    # p puts all mass on token 2; deterministic children 0 and 2: 0 is rejected, 2 accepted
    p = np.array([[0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.25] * 4])
    draft = Draft(tokens=(0, 2), parents=(-1, -1))
    verdict = verify_sampled(draft, p, np.random.default_rng(0))
    assert verdict.path == (1,)
