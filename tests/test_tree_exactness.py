"""Trees and long verifies on CPU keep plain decoding's bits: a tree forward kept to one path
leaves the cache as a chain forward of that path would, and speculative output equals plain
output at every k the engine allows, in every CPU dtype."""

from __future__ import annotations

import pytest
import torch

from app.core.engine import MAX_K, SpecEngine
from app.core.types import SamplingParams
from app.drafters.draft_model import DraftModelDrafter
from backends.torch.backend import TorchBackend, cpu_has_native_bf16
from backends.torch.exactness import exact_row_block
from backends.torch.quantized_linear import w8a8_is_exact
from tests.marks import heavy
from tests.tiny import W4A8, save_hf_folder, tiny_llama

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]
BF16 = pytest.param("bfloat16", marks=pytest.mark.skipif(
    not cpu_has_native_bf16(), reason="bf16 row invariance is claimed where bf16 is native"))
W8A8 = pytest.param("w8a8", marks=pytest.mark.skipif(
    not w8a8_is_exact(), reason="this CPU's int8 matmul saturates: specdeck refuses w8a8"))
# `make check` keeps float32 and int8 (runs on every CPU); `make test` sweeps them all
DTYPES = ["float32", *heavy(BF16), "int8", *heavy(W8A8, "int4", W4A8)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_hf_folder(tiny_llama(seed=1), tmp_path_factory.mktemp("tree") / "tiny")


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    return save_hf_folder(tiny_llama(seed=2), tmp_path_factory.mktemp("tree") / "draft")


@pytest.fixture(scope="module")
def load(folder, draft_folder):
    """load(dtype) -> the target, load(dtype, draft=True) -> the draft: each loaded once per
    module (quantizing at load is most of a test's cost). A test may share them: sessions keep
    their own caches, and a draft model is never used as a target (a drafter lightens it)."""
    loaded = {}

    def load(dtype: str, draft: bool = False):
        if (dtype, draft) not in loaded:
            path = draft_folder if draft else folder
            loaded[dtype, draft] = TorchBackend().load(str(path), device="cpu", dtype=dtype)
        return loaded[dtype, draft]

    return load


# a root with three children; the middle one carries a branch two deep
TOKENS = (4, 7, 2, 11, 6, 3, 8)
PARENTS = (-1, -1, -1, 1, 1, 3, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leaf", [0, 5, 6])
def test_a_tree_forward_kept_to_one_path_equals_a_chain_forward_of_it_bit_for_bit(
        load, dtype, leaf):
    model = load(dtype)
    path = [leaf]
    while PARENTS[path[0]] >= 0:
        path.insert(0, PARENTS[path[0]])
    tree, chain = model.start(), model.start()
    for session in (tree, chain):
        session.forward(PROMPT[:-1])
    base = tree.length
    rows = (-1, *(p + 1 for p in PARENTS))
    tree_out = tree.forward([PROMPT[-1], *TOKENS], n_logits=len(TOKENS) + 1, parents=rows)
    chain_out = chain.forward([PROMPT[-1], *(TOKENS[i] for i in path)], n_logits=len(path) + 1)
    tree_logits, chain_logits = tree_out.host_logits(), chain_out.host_logits()
    for depth, node in enumerate([-1, *path]):
        same(tree_logits[node + 1], chain_logits[depth], dtype)
    tree.keep(base, (0, *(i + 1 for i in path)))
    assert tree.tokens == chain.tokens
    after_tree, after_chain = (s.forward([3]).host_logits() for s in (tree, chain))
    same(after_tree, after_chain, dtype)


def same(a, b, dtype: str) -> None:
    """Bit for bit in low precision; float32's one-row kernel rounds its own way (see
    TorchModel.check_exactness), so there the last bits may differ and the choice may not."""
    if dtype != "float32":
        assert (a == b).all()
        return
    assert abs(a - b).max() < 1e-4 and (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [*heavy(1, 8, 16), MAX_K])
def test_speculative_output_is_plain_output_at_every_k_the_engine_allows(
        load, dtype, k):
    target = load(dtype)
    params = SamplingParams(max_new_tokens=48)
    plain = list(SpecEngine(target).generate(PROMPT, params))[-1]
    # the target drafting for itself accepts long drafts, so whole k+1-row verifies happen
    for draft in (target, load(dtype, draft=True)):
        done = list(SpecEngine(target, DraftModelDrafter(target, draft), k=k).generate(
            PROMPT, params))[-1]
        assert done.token_ids == plain.token_ids, (dtype, k, draft.name)


def test_a_row_block_check_finds_where_a_kernel_stops_agreeing():
    class Drifting(torch.nn.Linear):
        """Rounds differently from 5 rows on, as a kernel switching blocking would."""

        def forward(self, x):
            out = super().forward(x)
            return out + 1e-3 if x.shape[0] >= 5 else out

    layer = Drifting(8, 8).bfloat16()
    assert exact_row_block([layer], min_rows=2, dtype=torch.bfloat16) == 4
    assert exact_row_block([torch.nn.Linear(8, 8).bfloat16()], min_rows=2,
                           dtype=torch.bfloat16) == 16


def test_k_over_the_engines_limit_is_refused_with_the_limit(folder):
    from app.core.types import SpecdeckError
    with pytest.raises(SpecdeckError, match=f"from 0 to {MAX_K}"):
        SpecEngine(TorchBackend().load(str(folder), device="cpu"), k=MAX_K + 1)
