"""Low-precision CPU numerics: a token's logits do not depend on the rows computed beside it, so
speculative decoding stays token-identical to plain decoding of the same configuration; and a
drafter restricted to part of the vocabulary changes only its acceptance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from app.core.engine import SpecEngine
from app.core.types import SamplingParams, SpecdeckError
from app.drafters.draft_model import DraftModelDrafter
from app.drafters.ngram import NgramDrafter
from backends.torch import backend as torch_backend
from backends.torch import quantized_linear as quant
from backends.torch.attention import NAME, rowwise_sdpa
from backends.torch.backend import TorchBackend, cpu_has_native_bf16
from backends.torch.fuse import FusedProjection, ProjectionSlice, fuse_projections
from backends.torch.layer_choice import quantize_linear
from backends.torch.quantized_linear import (
    Int4Linear,
    Int8Linear,
    W8A8Linear,
    w8a8_is_exact,
)
from tests.tiny import W4A8, save_hf_folder, tiny_llama

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]


class _Attention(torch.nn.Module):
    num_key_value_groups = 6  # Qwen2.5-1.5B's shape: 12 query heads over 2 KV heads
    is_causal = True


def _rows(query, key, value, context: int, n: int) -> torch.Tensor:
    """Attention of the n query rows that follow `context` keys, as a verify forward has it."""
    return rowwise_sdpa(_Attention(), query[:, :, :n], key[:, :, :context + n],
                        value[:, :, :context + n], None, scaling=128 ** -0.5)[0]


@pytest.mark.parametrize("context", [30, 126, 510])
def test_rowwise_attention_gives_a_row_the_same_bits_alone_or_in_a_verify_batch(context):
    torch.manual_seed(context)
    query, key, value = (torch.randn(1, heads, 700, 128).bfloat16() for heads in (12, 2, 2))
    batched = _rows(query, key, value, context, 12)
    for n in range(1, 12):
        assert torch.equal(_rows(query, key, value, context, n), batched[:, :n]), n


def test_rowwise_attention_is_causal_attention():
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, heads, 40, 128) for heads in (12, 2, 2))
    ours = _rows(query, key, value, 30, 8)  # [batch, rows, heads, dim]
    mask = torch.ones(8, 38, dtype=torch.bool).tril(30)
    reference = F.scaled_dot_product_attention(
        query[:, :, :8], key[:, :, :38].repeat_interleave(6, 1),
        value[:, :, :38].repeat_interleave(6, 1), attn_mask=mask)
    torch.testing.assert_close(ours, reference.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_hf_folder(tiny_llama(seed=1), tmp_path_factory.mktemp("exact") / "tiny")


@pytest.fixture(scope="module")
def load_target(tiny_folder):
    """load_target(dtype): tiny_folder loaded once per dtype in this module (quantizing at load
    is most of a test's cost). Only for targets, which tests share safely (sessions keep their
    own caches, and drafting for itself leaves a model as it was); a draft model is loaded
    fresh, since a drafter lightens its head or restricts its vocabulary."""
    loaded = {}

    def load(dtype: str):
        if dtype not in loaded:
            loaded[dtype] = TorchBackend().load(str(tiny_folder), device="cpu", dtype=dtype)
        return loaded[dtype]

    return load


NATIVE_BF16 = pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 row invariance was "
                                 "measured on CPUs that compute bf16 natively")


EXACT_W8A8 = pytest.mark.skipif(not w8a8_is_exact(), reason="this CPU's int8 matmul saturates "
                                "(no VNNI): specdeck refuses w8a8 here")
W8A8 = pytest.param("w8a8", marks=EXACT_W8A8)


def _cpu_has_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


@pytest.mark.parametrize("dtype, rows", [("int8", 1), pytest.param("w8a8", 1, marks=EXACT_W8A8),
                                         ("int4", 1), pytest.param("w4a8", 1, marks=W4A8.marks),
                                         pytest.param("bfloat16", 2,
                                                                   marks=NATIVE_BF16)])
def test_low_precision_cpu_targets_pad_only_what_their_matmuls_need(load_target, dtype, rows):
    model = load_target(dtype)
    assert model.hf.config._attn_implementation == NAME
    assert model.start().min_rows == rows
    session = model.start()
    session.forward(PROMPT, n_logits=1)
    batched = session.forward([3, 4, 5, 6, 7], n_logits=5).host_logits()
    session.rewind(len(PROMPT))
    for n in (1, 2, 3, 4):
        assert (session.forward([3, 4, 5, 6, 7][:n], n_logits=n).host_logits()
                == batched[:n]).all()
        session.rewind(len(PROMPT))


@pytest.mark.parametrize("dtype", ["int8", W8A8, "int4", W4A8])
def test_a_quantized_target_decodes_the_same_tokens_with_and_without_speculation(load_target,
                                                                               dtype):
    target = load_target(dtype)
    params = SamplingParams(max_new_tokens=40)
    plain = list(SpecEngine(target).generate(PROMPT, params))[-1]
    for drafter in (NgramDrafter(), DraftModelDrafter(target, target)):
        done = list(SpecEngine(target, drafter, k=3).generate(PROMPT, params))[-1]
        assert done.token_ids == plain.token_ids


def test_a_drafter_on_part_of_the_vocabulary_proposes_only_from_it_and_keeps_the_output(
        target, tiny_folder):
    draft = TorchBackend().load(str(tiny_folder), device="cpu", dtype="float32")
    drafter = DraftModelDrafter(target, draft, vocab_limit=8)
    params = SamplingParams(max_new_tokens=40)
    plain = list(SpecEngine(target).generate(PROMPT, params))[-1]
    done = list(SpecEngine(target, drafter, k=4).generate(PROMPT, params))[-1]
    assert done.token_ids == plain.token_ids
    allowed = {*range(8), *PROMPT, *target.eos_token_ids}
    session = drafter._session
    session.rewind(0)
    logits = session.forward(PROMPT, n_logits=1).host_logits()[0]
    assert {int(i) for i in (logits > float("-inf")).nonzero()[0]} == allowed
    session.restrict_vocab(None)
    session.rewind(0)
    assert (session.forward(PROMPT, n_logits=1).host_logits() > -1e30).all()


@pytest.mark.skipif(not _cpu_has_vnni(), reason="only CPUs with VNNI promise exact int8 sums")
def test_a_cpu_with_vnni_passes_the_exactness_check_so_w8a8_is_offered():
    assert w8a8_is_exact()


@EXACT_W8A8
def test_a_w8a8_layer_stays_within_int8_rounding_of_the_float_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    x = torch.randn(5, 256)
    ours = W8A8Linear.quantize(linear)(x).float()
    reference = linear(x).detach()
    assert (ours - reference).abs().max() < 0.02 * reference.abs().max()


def test_w8a8_is_refused_with_the_fix_where_the_int8_matmul_saturates(tiny_folder, monkeypatch):
    monkeypatch.setattr(torch_backend, "w8a8_is_exact", lambda: False)
    with pytest.raises(SpecdeckError, match="--dtype int8"):
        TorchBackend().load(str(tiny_folder), device="cpu", dtype="w8a8")


@pytest.mark.parametrize("dtype", ["int8", W8A8, "int4", W4A8])
def test_a_quantized_drafter_restricted_to_part_of_the_vocabulary_keeps_the_output(
        target, tiny_folder, dtype):
    draft = TorchBackend().load(str(tiny_folder), device="cpu", dtype=dtype)
    drafter = DraftModelDrafter(target, draft, vocab_limit=8)
    params = SamplingParams(max_new_tokens=30)
    plain = list(SpecEngine(target).generate(PROMPT, params))[-1]
    assert list(SpecEngine(target, drafter, k=4).generate(PROMPT, params))[-1].token_ids == \
        plain.token_ids


def test_an_int4_layer_stays_within_4_bit_rounding_of_the_float_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    x = torch.randn(5, 256)
    ours = Int4Linear.quantize(linear)(x).float()
    reference = linear(x).detach()
    assert (ours - reference).abs().max() < 0.1 * reference.abs().max()
    assert (ours - reference).abs().mean() < 0.03 * reference.abs().mean() * 4


def test_an_int4_layer_gives_each_row_of_a_block_its_one_row_bits():
    torch.manual_seed(0)
    layer = Int4Linear.quantize(torch.nn.Linear(256, 96, bias=False))
    block = torch.randn(16, 256).to(torch.bfloat16)  # exactness.MAX_BLOCK rows
    with torch.inference_mode():
        alone = torch.cat([layer(block[i:i + 1]) for i in range(len(block))])
        assert torch.equal(layer(block), alone)


@pytest.mark.parametrize("dtype", [W8A8, "int4", W4A8])
def test_a_prompt_longer_than_a_verify_decodes_the_same_with_and_without_speculation(
        load_target, dtype):
    target = load_target(dtype)
    prompt = (PROMPT * 20)[:torch_backend.MAX_VERIFY_ROWS + 9]  # prefilled in one forward
    params = SamplingParams(max_new_tokens=30)
    plain = list(SpecEngine(target).generate(prompt, params))[-1]
    for drafter in (NgramDrafter(), DraftModelDrafter(target, target)):
        done = list(SpecEngine(target, drafter, k=5).generate(prompt, params))[-1]
        assert done.token_ids == plain.token_ids


def test_an_int8_layer_runs_a_long_prompt_in_float32_where_the_cpu_lacks_native_bf16(
        monkeypatch):
    torch.manual_seed(0)
    layer = Int8Linear.quantize(torch.nn.Linear(256, 96, bias=False))
    rows = torch.randn(Int8Linear.FLOAT_ROWS, 256).to(torch.bfloat16)
    by_hand = ((rows.float() @ layer.weight_int8.float().t()) * layer.scales.float()).bfloat16()
    kernel = torch._weight_int8pack_mm(rows, layer.weight_int8, layer.scales)
    with torch.inference_mode():
        monkeypatch.setattr(quant, "_float_is_faster", lambda: True)
        assert torch.equal(layer(rows), by_hand)
        short = rows[:Int8Linear.FLOAT_ROWS - 1]  # fewer rows (a verify block): the kernel
        assert torch.equal(layer(short), kernel[:Int8Linear.FLOAT_ROWS - 1])
        monkeypatch.setattr(quant, "_float_is_faster", lambda: False)
        assert torch.equal(layer(rows), kernel)
    assert (by_hand.float() - kernel.float()).abs().max() < 0.02 * kernel.float().abs().max()


def test_int4_is_refused_off_the_cpu_with_the_fix(tiny_folder):
    with pytest.raises(SpecdeckError, match="CPU only"):
        torch_backend.resolve_dtype("int4", "cuda")


@pytest.mark.parametrize("dtype", ["float32", "int8", W8A8, "int4", W4A8])
def test_fused_projections_answer_as_the_separate_projections_did(dtype):
    torch.manual_seed(0)
    attention = torch.nn.Module()
    for name, out in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        attention.add_module(name, torch.nn.Linear(64, out, bias=True))
    x = torch.randn(3, 64)
    separate = {n: getattr(attention, n) for n in ("q_proj", "k_proj", "v_proj")}
    if dtype != "float32":
        separate = {n: quantize_linear(lin, dtype, is_head=False) for n, lin in separate.items()}
    expected = {n: lin(x) for n, lin in separate.items()}
    assert fuse_projections(attention) == 1
    assert isinstance(attention.q_proj, ProjectionSlice)
    if dtype != "float32":
        attention.qkv_fused.layer = quantize_linear(attention.qkv_fused.layer, dtype, is_head=False)
    for name in ("q_proj", "k_proj", "v_proj"):
        if dtype == "float32":
            torch.testing.assert_close(getattr(attention, name)(x), expected[name])
        else:  # per-channel or per-group codes: each output keeps its own; the sums are exact
            assert torch.equal(getattr(attention, name)(x), expected[name]), name


def test_a_fused_projection_recomputes_for_a_new_input_and_forgets_after_its_last_part():
    layer = torch.nn.Linear(4, 6)
    fused = FusedProjection(layer, [4, 2])
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    torch.testing.assert_close(fused.part(a, 0), layer(a)[:, :4])
    torch.testing.assert_close(fused.part(b, 1), layer(b)[:, 4:])  # not a's cached result
    assert fused._output is None
