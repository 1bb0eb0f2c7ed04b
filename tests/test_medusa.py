"""Medusa heads: the published names load, the logits equal the reference implementation's
(PyPI medusa-llm, golden values made by tests/fixtures/medusa/make_golden.py), the static tree
as a literal table, and speculative output equals plain decoding (greedy oracle at k 1, 2, 4,
7; sampled output keeps the target's law)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import Draft, SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from backends.torch.heads.medusa import (  # noqa: E402
    MedusaDrafter,
    MedusaHeads,
    default_choices,
    load_medusa,
)
from tests.distributions import assert_follows, first_two_law  # noqa: E402
from tests.marks import heavy  # noqa: E402
from tests.tiny import tiny_llama  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "medusa"
PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9, 12]


@pytest.fixture(scope="module")
def base():
    return TorchBackend().load(str(FIX / "base"), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def golden():
    return load_file(str(FIX / "golden.safetensors"))


@pytest.mark.parametrize("layers", [1, 2])
def test_head_logits_on_the_targets_final_hidden_equal_the_reference_implementation(
        base, golden, layers):
    heads = load_medusa(FIX / f"heads_l{layers}", hidden=32, vocab=48)
    drafter = MedusaDrafter(base, heads)
    ids = golden["input_ids"][0].tolist()
    out = base.start().forward(ids, n_logits=len(ids), capture=drafter.capture_layers)
    with torch.inference_mode():
        ours = heads(drafter.norm(out.hidden_states[drafter.capture_layers[0]]))
    assert heads.n_heads == 3 and heads.n_layers == layers
    torch.testing.assert_close(torch.from_numpy(out.host_logits()), golden["orig_logits"],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours, golden[f"medusa_logits_l{layers}"], atol=1e-4, rtol=1e-4)


def test_medusa_2_names_under_medusa_head_load_the_same_heads(tmp_path):
    state = load_file(str(FIX / "heads_l1" / "medusa_lm_head.safetensors"))
    save_file({f"medusa_head.{k}": v for k, v in state.items()},
              str(tmp_path / "model.safetensors"))
    one = load_medusa(FIX / "heads_l1", hidden=32, vocab=48)
    two = load_medusa(tmp_path, hidden=32, vocab=48)
    x = torch.randn(2, 32)
    assert torch.equal(one(x), two(x))


def test_the_default_tree_takes_top_ranks_first_and_every_parent_before_its_children():
    assert default_choices(3) == (
        (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0), (3, 0),
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0))
    assert default_choices(1, max_nodes=8) == ((0,), (1,), (2,), (3,))


def test_the_drafted_tree_maps_ranks_to_each_heads_tokens_within_depth_k(base):
    drafter = MedusaDrafter(base, MedusaHeads(3, 1, 32, 48), choices=default_choices(3))
    drafter._top = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    draft = drafter.propose([1, 2], k=2)
    assert draft.tokens == (10, 11, 12, 13, 20, 21, 22, 23, 20, 21, 20, 20)
    assert draft.parents == (-1, -1, -1, -1, 0, 0, 0, 0, 1, 1, 2, 3)
    assert max(draft.depths()) == 2 and draft.probs is None
    assert drafter.propose([1, 2], k=1).tokens == (10, 11, 12, 13)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_greedy_medusa_gives_exactly_the_oracles_tokens(base, layers, k):
    plain = list(SpecEngine(base).generate(PROMPT, SamplingParams(max_new_tokens=30)))[-1]
    drafter = build_drafter("medusa", base, backend=TorchBackend(),
                            head=str(FIX / f"heads_l{layers}"))
    done = list(SpecEngine(base).generate(PROMPT, SamplingParams(max_new_tokens=30),
                                          drafter=drafter, k=k))[-1]
    assert done.token_ids == plain.token_ids
    assert done.stats.drafted > 0


@pytest.mark.heavy  # 600 sampled generations
def test_sampled_medusa_commits_tokens_from_the_targets_own_distribution():
    vocab = 4
    model = tiny_llama(seed=3, vocab=vocab, hidden=16)
    model.eos_token_ids = frozenset()  # every generation runs to its length
    torch.manual_seed(4)
    heads = MedusaHeads(2, 1, 16, vocab)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 1.0)
    params = SamplingParams(temperature=1.0)
    prompt = [2, 3]
    expected = first_two_law(model, prompt, params, vocab)
    engine, n = SpecEngine(model), 600
    counts = np.zeros((vocab, vocab))
    choices = default_choices(2, max_nodes=6, ranks=3)
    for seed in range(n):
        # the second token is verified against a depth-1 tree (the third ends the generation)
        done = list(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3,
                                                           seed=seed),
                                    drafter=MedusaDrafter(model, heads, choices), k=2))[-1]
        counts[tuple(done.token_ids[:2])] += 1
    assert done.stats.drafted > 0
    assert_follows(counts, expected * n)


def test_a_pickle_only_head_is_refused_naming_the_safetensors_fix(tmp_path):
    (tmp_path / "medusa_lm_head.pt").write_bytes(b"not loaded")
    with pytest.raises(SpecdeckError, match="never loads.*medusa_lm_head.safetensors"):
        load_medusa(tmp_path, hidden=32, vocab=48)


def test_heads_trained_for_another_target_are_refused(base):
    with pytest.raises(SpecdeckError, match="hidden size 32, the target has 64"):
        load_medusa(FIX / "heads_l1", hidden=64, vocab=48)
    with pytest.raises(SpecdeckError, match="predict 48 tokens"):
        load_medusa(FIX / "heads_l1", hidden=32, vocab=50)


def test_medusa_without_its_head_folder_names_the_flag(base):
    with pytest.raises(SpecdeckError, match="--draft HEAD_DIR"):
        build_drafter("medusa", base, backend=TorchBackend())


def test_a_folder_without_medusa_tensors_is_refused(tmp_path):
    save_file({"lm_head.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_layers": 1}))
    with pytest.raises(SpecdeckError, match="no Medusa head tensors"):
        load_medusa(tmp_path, hidden=4, vocab=4)


def test_no_tree_is_drafted_before_the_heads_have_read_a_hidden_state(base):
    drafter = MedusaDrafter(base, MedusaHeads(2, 1, 32, 48))
    assert drafter.propose([1, 2, 3], k=4) == Draft()
