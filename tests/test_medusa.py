"""Medusa heads, on torch and on MLX (its CPU build here): the published names load on both,
the logits equal the reference implementation's (PyPI medusa-llm, golden values made by
tests/fixtures/medusa/make_golden.py), the static tree as a literal table, both backends draft
the same trees, and speculative output equals plain decoding (greedy oracle at k 1, 2, 4, 7;
sampled output keeps the target's law). Folders it cannot run are refused naming why."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.numpy import load_file as load_numpy  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import Draft, SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends import load_backend  # noqa: E402
from backends.heads.medusa_drafter import MedusaDrafter, default_choices, medusa_logits  # noqa: E402
from backends.heads.medusa_format import read_medusa  # noqa: E402
from backends.torch.arrays import TorchArrays  # noqa: E402
from backends.torch.head_weights.medusa import MedusaHeads  # noqa: E402
from tests.distributions import assert_first_two_follow  # noqa: E402
from tests.fakes import RecordingDrafter  # noqa: E402
from tests.marks import heavy  # noqa: E402
from tests.tiny import mlx_twin, tiny_llama  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "medusa"
PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9, 12]
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                               reason="mlx-lm is not installed")
BACKENDS = ("torch", pytest.param("mlx", marks=needs_mlx))


def load_base(name: str):
    return load_backend(name).load(str(FIX / "base"), device="cpu", dtype="float32")


@pytest.fixture(scope="module", params=BACKENDS)
def on(request):
    """(backend, the fixture's base target on it) for each backend."""
    return load_backend(request.param), load_base(request.param)


@pytest.fixture(scope="module")
def golden():
    return load_numpy(str(FIX / "golden.safetensors"))


def medusa(on, folder: str | Path, choices=None) -> MedusaDrafter:
    """The Medusa drafter of a head folder on `on`'s target."""
    backend, target = on
    module = importlib.import_module(f"backends.{backend.name}.head_weights.medusa")
    return module.load_medusa_drafter(target, str(folder), choices)


def logits_of(drafter: MedusaDrafter, hidden) -> np.ndarray:
    """The heads' logits [n_heads, rows, vocab] on the host, for target states [rows, H]."""
    xp = drafter.arrays
    with xp.context():
        return xp.to_numpy(xp.float32(medusa_logits(drafter.heads, xp, drafter.norm(hidden))))


def stand_in(n_heads: int, choices=None) -> MedusaDrafter:
    """A drafter whose heads have not read a state yet (its tree is set by hand)."""
    return MedusaDrafter(MedusaHeads(n_heads, 1, 32, 48), TorchArrays("cpu"), lambda h: h,
                         n_layers=2, choices=choices)


@pytest.mark.parametrize("layers", [1, 2])
def test_head_logits_on_the_targets_final_hidden_equal_the_reference_implementation(
        on, golden, layers):
    _, target = on
    drafter = medusa(on, FIX / f"heads_l{layers}")
    ids = golden["input_ids"][0].tolist()
    out = target.start().forward(ids, n_logits=len(ids), capture=drafter.capture_layers)
    ours = logits_of(drafter, out.hidden_states[drafter.capture_layers[0]])
    assert drafter.heads.n_heads == 3 and drafter.heads.n_layers == layers
    np.testing.assert_allclose(out.host_logits(), golden["orig_logits"], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(ours, golden[f"medusa_logits_l{layers}"], atol=1e-4, rtol=1e-4)


def test_medusa_2_names_under_medusa_head_load_the_same_heads(on, tmp_path):
    state = load_file(str(FIX / "heads_l1" / "medusa_lm_head.safetensors"))
    save_file({f"medusa_head.{k}": v for k, v in state.items()},
              str(tmp_path / "model.safetensors"))
    one, two = medusa(on, FIX / "heads_l1"), medusa(on, tmp_path)
    x = one.arrays.asarray(np.random.default_rng(0).normal(size=(2, 32)), "float")
    assert np.array_equal(logits_of(one, x), logits_of(two, x))


def test_the_default_tree_takes_top_ranks_first_and_every_parent_before_its_children():
    assert default_choices(3) == (
        (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0), (3, 0),
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0))
    assert default_choices(1, max_nodes=8) == ((0,), (1,), (2,), (3,))


def test_the_drafted_tree_maps_ranks_to_each_heads_tokens_within_depth_k():
    drafter = stand_in(3, choices=default_choices(3))
    drafter._top = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    draft = drafter.propose([1, 2], k=2)
    assert draft.tokens == (10, 11, 12, 13, 20, 21, 22, 23, 20, 21, 20, 20)
    assert draft.parents == (-1, -1, -1, -1, 0, 0, 0, 0, 1, 1, 2, 3)
    assert max(draft.depths()) == 2 and draft.probs is None
    assert drafter.propose([1, 2], k=1).tokens == (10, 11, 12, 13)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_greedy_medusa_gives_exactly_the_oracles_tokens(on, layers, k):
    backend, target = on
    plain = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=30)))[-1]
    drafter = build_drafter("medusa", target, backend=backend,
                            head=str(FIX / f"heads_l{layers}"))
    done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=30),
                                            drafter=drafter, k=k))[-1]
    assert done.token_ids == plain.token_ids
    assert done.stats.drafted > 0


@needs_mlx
@pytest.mark.parametrize("layers", [1, 2])
def test_mlx_drafts_the_trees_torch_drafts_and_commits_the_same_tokens(layers):
    runs = {}
    for name in ("torch", "mlx"):
        on = (load_backend(name), load_base(name))
        drafter = RecordingDrafter(medusa(on, FIX / f"heads_l{layers}"))
        done = list(SpecEngine(on[1]).generate(PROMPT, SamplingParams(max_new_tokens=30),
                                               drafter=drafter, k=3))[-1]
        runs[name] = (done.token_ids, [(d.tokens, d.parents) for d in drafter.drafts])
    assert runs["mlx"] == runs["torch"]
    assert any(len(tokens) == 16 for tokens, _ in runs["mlx"][1])  # whole default trees


def write_random_heads(folder: Path, n_heads: int, hidden: int, vocab: int, seed: int) -> Path:
    """Medusa-1 heads (one layer) of random weights, large enough to draft varied trees."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(n_heads):
        state[f"{i}.0.linear.weight"] = torch.randn(hidden, hidden, generator=gen)
        state[f"{i}.0.linear.bias"] = torch.randn(hidden, generator=gen)
        state[f"{i}.1.weight"] = torch.randn(vocab, hidden, generator=gen)
    folder.mkdir(parents=True)
    save_file(state, str(folder / "medusa_lm_head.safetensors"))
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": n_heads,
                                                    "medusa_num_layers": 1}))
    return folder


@pytest.mark.heavy  # 600 sampled generations
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_medusa_commits_tokens_from_the_targets_own_distribution(backend, tmp_path):
    vocab = 4
    model = tiny_llama(seed=3, vocab=vocab, hidden=16)
    target = model if backend == "torch" else mlx_twin(model, tmp_path / "target")
    target.eos_token_ids = frozenset()  # every generation runs to its length
    heads = write_random_heads(tmp_path / "heads", 2, 16, vocab, seed=4)
    drafter = medusa((load_backend(backend), target), heads,
                     default_choices(2, max_nodes=6, ranks=3))  # begin() reads afresh
    # the second token is verified against a depth-1 tree (the third ends the generation)
    assert_first_two_follow(target, drafter, [2, 3], vocab, n=600)


def test_a_pickle_only_head_is_refused_naming_the_safetensors_fix(tmp_path):
    (tmp_path / "medusa_lm_head.pt").write_bytes(b"not loaded")
    with pytest.raises(SpecdeckError, match="never loads.*medusa_lm_head.safetensors"):
        read_medusa(tmp_path, hidden=32, vocab=48)


def test_heads_trained_for_another_target_are_refused(on, tmp_path):
    with pytest.raises(SpecdeckError, match="hidden size 16, the target has 32"):
        medusa(on, write_random_heads(tmp_path / "h16", 2, 16, 48, seed=0))
    with pytest.raises(SpecdeckError, match="predict 50 tokens"):
        medusa(on, write_random_heads(tmp_path / "v50", 2, 32, 50, seed=0))


def test_heads_whose_tensors_do_not_fit_together_are_refused_naming_one(tmp_path):
    folder = write_random_heads(tmp_path / "heads", 2, 32, 48, seed=0)
    state = load_file(str(folder / "medusa_lm_head.safetensors"))
    state["1.0.linear.bias"] = torch.zeros(16)
    save_file(state, str(folder / "medusa_lm_head.safetensors"))
    with pytest.raises(SpecdeckError, match=r"do not fit together.*1\.0\.linear\.bias \(16,\)"):
        read_medusa(folder, hidden=32, vocab=48)


def test_medusa_without_its_head_folder_names_the_flag(on):
    backend, target = on
    with pytest.raises(SpecdeckError, match="--draft HEAD_DIR"):
        build_drafter("medusa", target, backend=backend)


def test_a_folder_without_medusa_tensors_is_refused(tmp_path):
    save_file({"lm_head.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_layers": 1}))
    with pytest.raises(SpecdeckError, match="no Medusa head tensors"):
        read_medusa(tmp_path, hidden=4, vocab=4)


def test_no_tree_is_drafted_before_the_heads_have_read_a_hidden_state():
    assert stand_in(2).propose([1, 2, 3], k=4) == Draft()
