"""Trees on the MLX backend: a tree forward scores each branch as a chain forward of it does,
keeping one path leaves the cache as that chain would, tree drafters keep plain decoding's
greedy tokens, and architectures whose attention is not patched fall back to chains."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends.mlx import tree as mlx_tree  # noqa: E402
from backends.mlx.backend import MlxBackend  # noqa: E402
from tests.tiny import save_hf_folder, tiny_llama  # noqa: E402

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]
# a root with three children; the middle one carries a branch two deep
TOKENS = (4, 7, 2, 11, 6, 3, 8)
PARENTS = (-1, -1, -1, 1, 1, 3, 4)
ROWS = (-1, *(p + 1 for p in PARENTS))  # the pending token first: the draft hangs below it
LEAVES = [0, 2, 5, 6]
# every token of the tiny vocabulary but 0 and 1 (eos) twice, followed by two others: a lookup
# finds two continuations of almost any last token, so the drafts are trees
BRANCHING = [*range(2, 48), *((7 * i) % 46 + 2 for i in range(46))]


def path_to(leaf: int) -> list[int]:
    path = [leaf]
    while PARENTS[path[0]] >= 0:
        path.insert(0, PARENTS[path[0]])
    return path


def tree_and_chain(model, leaf: int):
    """Two sessions after the same prompt: one runs the tree, the other the leaf's chain."""
    tree, chain = model.start(), model.start()
    for session in (tree, chain):
        session.forward(PROMPT[:-1])
    tree_out = tree.forward([PROMPT[-1], *TOKENS], n_logits=len(ROWS), parents=ROWS)
    path = path_to(leaf)
    chain_out = chain.forward([PROMPT[-1], *(TOKENS[i] for i in path)], n_logits=len(path) + 1)
    return tree, chain, tree_out, chain_out


def plain(model, prompt: list[int], n: int) -> list[int]:
    done = list(SpecEngine(model).generate(prompt, SamplingParams(max_new_tokens=n)))[-1]
    return list(done.token_ids)


def test_the_tiny_llama_verifies_trees_on_mlx(mlx_target):
    assert mlx_target.capabilities.tree_attention, mlx_target.capabilities.reason


@pytest.mark.parametrize("leaf", LEAVES)
def test_an_mlx_tree_forward_scores_each_branch_as_its_own_chain_does(mlx_target, leaf):
    _, _, tree_out, chain_out = tree_and_chain(mlx_target, leaf)
    tree_logits, chain_logits = tree_out.host_logits(), chain_out.host_logits()
    for depth, node in enumerate([-1, *path_to(leaf)]):
        # bit for bit: each row rotates and attends over exactly its chain twin's values
        np.testing.assert_array_equal(tree_logits[node + 1], chain_logits[depth])
        assert tree_out.argmax[node + 1] == chain_out.argmax[depth]


@pytest.mark.parametrize("leaf", LEAVES)
def test_keeping_a_tree_path_leaves_the_cache_a_chain_of_that_path_would(mlx_target, leaf):
    tree, chain, _, _ = tree_and_chain(mlx_target, leaf)
    tree.keep(len(PROMPT) - 1, (0, *(i + 1 for i in path_to(leaf))))
    assert (tree.length, tree.tokens) == (chain.length, chain.tokens)
    after_tree, after_chain = (s.forward([3, 4, 5], n_logits=3).host_logits()
                               for s in (tree, chain))
    np.testing.assert_array_equal(after_tree, after_chain)


def test_a_tree_forward_captures_every_rows_hidden_state_as_its_chain_does(mlx_target):
    tree, chain = mlx_target.start(), mlx_target.start()
    for session in (tree, chain):
        session.forward(PROMPT[:-1])
    tree_out = tree.forward([PROMPT[-1], *TOKENS], n_logits=len(ROWS), parents=ROWS,
                            capture=(1,))
    path = path_to(6)
    chain_out = chain.forward([PROMPT[-1], *(TOKENS[i] for i in path)], capture=(1,))
    rows = [0, *(i + 1 for i in path)]
    assert tree_out.hidden_states[1].shape[0] == len(ROWS)
    np.testing.assert_array_equal(np.array(tree_out.hidden_states[1][mx.array(rows)]),
                                  np.array(chain_out.hidden_states[1]))


@pytest.fixture
def spied(monkeypatch) -> dict[str, list]:
    """What the MLX tree module was asked: the trees forwarded, the paths kept off their first
    chain."""
    seen: dict[str, list] = {"trees": [], "kept": []}
    tree_rows, keep_path = mlx_tree.tree_rows, mlx_tree.keep_path

    def spy_rows(net, caches, parents, dtype):
        seen["trees"].append(parents)
        return tree_rows(net, caches, parents, dtype)

    def spy_keep(caches, length, rows):
        seen["kept"].append(tuple(rows))
        keep_path(caches, length, rows)

    monkeypatch.setattr(mlx_tree, "tree_rows", spy_rows)
    monkeypatch.setattr(mlx_tree, "keep_path", spy_keep)
    return seen


@pytest.mark.parametrize("kind", ["ngram-tree", "lookahead"])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_tree_drafters_on_mlx_give_plain_decodings_tokens(mlx_target, spied, kind, k):
    truth = plain(mlx_target, BRANCHING, 40)
    drafter = build_drafter(kind, mlx_target, backend=MlxBackend())
    done = list(SpecEngine(mlx_target).generate(BRANCHING, SamplingParams(max_new_tokens=40),
                                                drafter=drafter, k=k))[-1]
    assert done.error is None, done.error
    assert list(done.token_ids) == truth
    assert done.stats.drafted > 0
    if k > 1:  # a tree needs two levels below the pending token; k = 1 drafts one
        assert spied["trees"], "no step verified a tree"
        assert spied["kept"], "no step kept a branch other than the first"


@pytest.fixture
def unpatched(tmp_path, monkeypatch):
    """The tiny llama loaded as if mlx-lm's llama attention were not one specdeck patches."""
    monkeypatch.setattr(mlx_tree, "PATCHED", frozenset({"qwen2"}))
    folder = save_hf_folder(tiny_llama(1), tmp_path / "m")
    return MlxBackend().load(str(folder), device="cpu", dtype="float32")


def test_an_architecture_specdeck_does_not_patch_says_why_and_verifies_chains(unpatched):
    assert not unpatched.capabilities.tree_attention
    assert "llama attention" in unpatched.capabilities.reason
    assert "--backend torch" in unpatched.capabilities.reason
    session = unpatched.start()
    session.forward(PROMPT[:-1])
    with pytest.raises(SpecdeckError, match="cannot verify trees on MLX: mlx-lm's llama"):
        session.forward([PROMPT[-1], *TOKENS], n_logits=len(ROWS), parents=ROWS)


def test_on_an_unpatched_architecture_tree_drafters_still_give_plain_tokens(unpatched):
    drafter = build_drafter("ngram-tree", unpatched, backend=MlxBackend())
    done = list(SpecEngine(unpatched).generate(PROMPT, SamplingParams(max_new_tokens=24),
                                               drafter=drafter, k=4))[-1]
    assert list(done.token_ids) == plain(unpatched, PROMPT, 24)
