"""A .gguf runs on its own blocks: what its dequantized twin computes, with no copy of its
weights in memory or on disk, and speculation on it stays lossless."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

torch = pytest.importorskip("torch")

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import Done, SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from app.drafters.ngram import NgramDrafter  # noqa: E402
from backends.gguf import CONVERTED_SUFFIX  # noqa: E402
from backends.gguf_tensors import open_tensors  # noqa: E402
from backends.torch import gguf_model, lean_ops  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from backends.torch.gguf_layers import GgufLinear  # noqa: E402
from tests.distributions import assert_follows, two_token_law  # noqa: E402
from tests.test_engine import oracle  # noqa: E402
from tests.tiny import dequantized_twin, save_gguf, tiny_llama, tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.skipif(gguf_model.unavailable_reason() is not None,
                                reason=f"no GGUF kernel here: {gguf_model.unavailable_reason()}")
PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]
KS = [1, 2, 4, 7]


@pytest.fixture(scope="module")
def source():
    return tiny_llama(seed=1)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {"target": save_gguf(source, folder / "target.gguf", int(T.Q8_0)),
            "draft": save_gguf(tiny_llama(seed=2), folder / "draft.gguf", int(T.Q4_0))}


@pytest.fixture(scope="module")
def target(files):
    model = TorchBackend().load(str(files["target"]), device="cpu", dtype="auto")
    model.eos_token_ids = frozenset()
    return model


@pytest.fixture(scope="module")
def draft(files):
    return TorchBackend().load(str(files["draft"]), device="cpu", dtype="auto")


def generate(target, drafter=None, k: int = 0, **params) -> Done:
    engine = SpecEngine(target)
    done = list(engine.generate(PROMPT, SamplingParams(max_new_tokens=24, **params),
                                drafter=drafter, k=k))[-1]
    assert isinstance(done, Done) and done.error is None, done
    return done


def test_auto_runs_a_gguf_on_its_own_blocks(target):
    assert target.dtype == "gguf" and "nothing converted" in target.dtype_reason
    linears = [m for m in target.hf.modules() if isinstance(m, GgufLinear)]
    assert len(linears) == 2 * 4 + 1  # q/k/v and gate/up fused, o and down, output layer


def test_a_gguf_model_computes_what_its_dequantized_twin_computes(source, target):
    twin = dequantized_twin(source, int(T.Q8_0))
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ours, theirs = target.hf(ids).logits, twin.hf(ids).logits
    # the only difference: activations quantized to 8 bits per group, as llama.cpp does
    assert float((ours - theirs).norm() / theirs.norm()) < 0.02
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_model_keeps_no_copy_of_the_files_weights(files, target):
    stored = open_tensors(files["target"]).weights_bytes()
    assert 0.9 * stored < target.weights_bytes() < 1.3 * stored
    assert not files["target"].with_name(files["target"].name + CONVERTED_SUFFIX).exists()


def test_plain_decoding_on_a_gguf_is_the_oracle(target):
    assert list(generate(target).token_ids) == oracle(target, PROMPT, 24)


@pytest.mark.parametrize("k", KS)
def test_a_gguf_draft_model_keeps_the_plain_output(target, draft, k):
    plain = generate(target)
    drafter = TorchBackend().make_drafter("draft", target, draft=draft)
    assert list(generate(target, drafter, k=k).token_ids) == list(plain.token_ids)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("model", ["target", "wide"])  # wide: the steps between matmuls in C
def test_the_target_as_its_own_gguf_drafter_accepts_every_token(request, model, k):
    target = request.getfixturevalue(model)
    drafter = TorchBackend().make_drafter("draft", target, draft=target)
    done = generate(target, drafter, k=k)
    assert list(done.token_ids) == list(generate(target).token_ids)
    assert done.stats.accepted == done.stats.drafted > 0


@pytest.mark.parametrize("k", KS)
def test_lookup_on_a_gguf_keeps_the_plain_output(target, k):
    done = generate(target, NgramDrafter(), k=k)
    assert list(done.token_ids) == list(generate(target).token_ids)


@pytest.mark.heavy  # 900 sampled generations
def test_sampled_speculation_on_a_gguf_draws_from_the_targets_distribution(tmp_path):
    vocab = 16  # the smallest vocabulary kquant's 16-row tiles hold whole
    files = [save_gguf(tiny_llama(seed=seed, vocab=vocab), tmp_path / f"{seed}.gguf", kind)
             for seed, kind in ((21, int(T.Q8_0)), (22, int(T.Q4_0)))]
    target, draft = (TorchBackend().load(str(f), device="cpu", dtype="gguf") for f in files)
    target.eos_token_ids = frozenset()  # every generation runs its full length
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    prompt = [1, 2, 3, 4]
    joint = two_token_law(target, prompt, params, vocab)
    drafter = TorchBackend().make_drafter("draft", target, draft=draft)
    engine = SpecEngine(target)
    counts, n, accepted = np.zeros((vocab, vocab)), 900, 0
    for seed in range(n):
        done = list(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=4,
                                                           seed=seed), drafter=drafter, k=2))[-1]
        counts[tuple(done.token_ids[1:3])] += 1
        accepted += done.stats.accepted
    assert_follows(counts, joint * n)
    assert accepted > 0  # the rejection rule was exercised on accepted drafts too


# ---- the steps between matmuls in C (lean_ops): widths that fill whole vectors ----------

needs_lean_ops = pytest.mark.skipif(not lean_ops.is_available(),
                                    reason="lean_ops needs AVX2 or AVX-512 and a C compiler")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A GGUF whose hidden size, MLP width and head_dim (16) fill whole vectors."""
    folder = tmp_path_factory.mktemp("wide")
    model = TorchBackend().load(
        str(save_gguf(tiny_llama(seed=4, hidden=64), folder / "wide.gguf", int(T.Q8_0))),
        device="cpu", dtype="auto")
    model.eos_token_ids = frozenset()
    return model


@needs_lean_ops
def test_a_gguf_forward_takes_its_steps_between_matmuls_in_c(wide, target):
    assert wide.lean.in_c
    assert not target.lean.in_c  # head_dim 8 fills no vector: the torch steps


def logits_of(model, in_c: bool, rows: int = len(PROMPT)) -> torch.Tensor:
    model.lean.in_c = in_c
    try:
        return torch.as_tensor(model.start().forward(PROMPT, n_logits=rows).host_logits())
    finally:
        model.lean.in_c = lean_ops.is_available()


@needs_lean_ops
def test_the_c_steps_compute_what_the_torch_steps_compute(wide):
    ours, torch_steps = logits_of(wide, True), logits_of(wide, False)
    assert float((ours - torch_steps).norm() / torch_steps.norm()) < 0.02
    assert torch.equal(ours.argmax(-1), torch_steps.argmax(-1))


@needs_lean_ops
def test_on_the_c_steps_each_row_gets_its_one_row_bits_in_any_block(wide):
    block = logits_of(wide, True)
    session = wide.start()
    alone = [torch.as_tensor(session.forward([t]).host_logits()[-1]) for t in PROMPT]
    assert torch.equal(block, torch.stack(alone))


@needs_lean_ops
def test_lean_ops_give_a_row_its_one_row_bits_in_any_block_and_a_tree_row_its_twins():
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, width, inter, prefix, rows = 4, 2, 32, 64, 48, 20, 8
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    x, delta = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    weight, gate_up = torch.rand(width, generator=g), 6 * torch.randn(rows, 2 * inter, generator=g)
    cos, sin = torch.rand(rows, dim, generator=g), torch.rand(rows, dim, generator=g)
    cache = torch.randn(2, kv_heads, 64, dim, generator=g)

    def steps(r: slice, first: int, cache: torch.Tensor, slots: lean_ops.Slots | None = None
              ) -> tuple[list[torch.Tensor], torch.Tensor]:
        q, kv = qkv[r].clone(), cache.clone()
        lean_ops.rope(q, heads + kv_heads, dim, cos[r].contiguous(), sin[r].contiguous())
        lean_ops.store_kv(q, heads * dim, (heads + kv_heads) * dim, kv_heads, dim, kv[0], kv[1],
                          first)
        seen = slots or lean_ops.Slots.of(None, first, q.shape[0])
        return [lean_ops.rmsnorm(x[r].contiguous(), weight, 1e-6),
                *lean_ops.add_rmsnorm(x[r].contiguous(), delta[r].contiguous(), weight, 1e-6),
                lean_ops.silu_mul(gate_up[r].contiguous(), inter), q,
                lean_ops.attention(q, heads, kv_heads, dim, kv[0], kv[1], seen, dim ** -0.5)], kv

    # rows see 21..28 slots: a whole vector of scores and a tail of 5..12
    block, stored = steps(slice(0, rows), prefix, cache)
    for r in range(rows):
        alone, _ = steps(slice(r, r + 1), prefix + r, stored)
        assert all(torch.equal(b[r:r + 1], a) for b, a in zip(block, alone))
    # a tree row over slots 0..19 and 40..46 (itself last) reads what its chain twin reads
    # from slots 0..26
    cache[:, :, prefix:27] = cache[:, :, 40:47]
    tree, _ = steps(slice(3, 4), 46, cache,
                    lean_ops.Slots.of([torch.tensor([*range(prefix), *range(40, 47)])], 46, 1))
    chain, _ = steps(slice(3, 4), 26, cache)
    assert torch.equal(tree[-1], chain[-1])


@needs_lean_ops
def test_on_the_c_steps_plain_decoding_is_the_oracle(wide):
    assert list(generate(wide).token_ids) == oracle(wide, PROMPT, 24)


@needs_lean_ops
@pytest.mark.parametrize("kind", ["ngram", "ngram-tree", "lookahead"])
@pytest.mark.parametrize("k", KS)
def test_on_the_c_steps_chains_and_trees_keep_the_plain_output(wide, kind, k):
    drafter = build_drafter(kind, wide, backend=TorchBackend())
    assert list(generate(wide, drafter, k=k).token_ids) == list(generate(wide).token_ids)


def test_an_old_dequantized_copy_is_removed_and_said(files, capsys):
    stale = files["draft"].with_name(files["draft"].name + CONVERTED_SUFFIX)
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(bytes(1024))
    TorchBackend().load(str(files["draft"]), device="cpu", dtype="gguf")
    assert not stale.exists()
    assert "removed" in capsys.readouterr().err


def test_a_gguf_cut_short_is_refused_with_the_fix(files, tmp_path):
    data = files["target"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(SpecdeckError, match="cut short.*specdeck pull"):
        open_tensors(cut)


def test_dtype_gguf_needs_a_gguf_file(tmp_path):
    with pytest.raises(SpecdeckError, match="not one"):
        TorchBackend().load(str(tmp_path), device="cpu", dtype="gguf")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Qwen3 GGUF (per-head q/k norms) whose widths fill whole vectors."""
    source = tiny_qwen3(seed=5)
    folder = tmp_path_factory.mktemp("qwen3")
    model = TorchBackend().load(str(save_gguf(source, folder / "qwen3.gguf", int(T.Q8_0))),
                                device="cpu", dtype="auto")
    model.eos_token_ids = frozenset()
    return source, model


def test_a_qwen3_gguf_runs_the_lean_forward_and_computes_what_its_dequantized_twin_computes(
        qwen3):
    source, model = qwen3
    assert model.lean is not None
    assert model.lean.in_c == lean_ops.is_available()
    twin = dequantized_twin(source, int(T.Q8_0))
    ours = torch.as_tensor(model.start().forward(PROMPT, n_logits=len(PROMPT)).host_logits())
    theirs = torch.as_tensor(twin.start().forward(PROMPT, n_logits=len(PROMPT)).host_logits())
    assert float((ours - theirs).norm() / theirs.norm()) < 0.02
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("kind", ["ngram", "ngram-tree"])
def test_on_a_qwen3_gguf_plain_decoding_is_the_oracle_and_lookup_keeps_it(qwen3, kind):
    _, model = qwen3
    plain = list(generate(model).token_ids)
    assert plain == oracle(model, PROMPT, 24)
    drafter = build_drafter(kind, model, backend=TorchBackend())
    assert list(generate(model, drafter, k=4).token_ids) == plain
