"""The w4a8 kernel: 4-bit weights times per-group int8 activations, computed as specified
(checked against a float64 reference of the same arithmetic), row-invariant, refused with the
fix where it cannot run."""

from __future__ import annotations

import pytest
import torch

from app.core.types import SpecdeckError
from backends.torch import backend as torch_backend
from backends.torch import w4a8
from backends.torch.quantized_linear import quantize_weight_int4
from tests.tiny import W4A8

pytestmark = list(W4A8.marks)


def _reference(linear: torch.nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 of the spec, and the sum of its terms' magnitudes (what float32 sums err by):
    activations quantized per row and group of 32 (scale max|x|/127, round half to even in
    float32), weights (code - 8) * scale + zero."""
    codes, table = quantize_weight_int4(linear.weight, w4a8.GROUP)
    out_features, in_features = codes.shape
    groups = in_features // w4a8.GROUP
    xg = x.float().reshape(len(x), groups, w4a8.GROUP)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    inverse = torch.full_like(amax, 127.0) / amax  # as the kernel divides, in float32
    q = torch.round(xg * inverse).clamp(-127, 127).double()
    a = (amax / torch.full_like(amax, 127.0)).double()
    scale, zero = (table[..., i].t().double() for i in (0, 1))  # [out, groups]
    integer = torch.einsum("rgi,ogi->rog", q, codes.double().reshape(out_features, groups, -1)
                           - 8)
    scaled = integer * a[:, None, :, 0] * scale
    zeroed = (q.sum(-1) * a[..., 0])[:, None, :] * zero
    return (scaled + zeroed).sum(-1), (scaled.abs() + zeroed.abs()).sum(-1)


def test_a_w4a8_layer_computes_the_group_quantized_product_as_specified():
    torch.manual_seed(0)
    linear = torch.nn.Linear(1536, 256, bias=False)
    with torch.no_grad():
        linear.weight.normal_(0, 0.02)
    x = torch.randn(5, 1536).to(torch.bfloat16)
    with torch.inference_mode():
        ours = w4a8.W4A8Linear.quantize(linear)(x).double()
    reference, magnitude = _reference(linear, x)
    # the kernel sums 2 terms a group in float32, then rounds to bf16 once
    bound = 2 ** -8 * reference.abs() + 4 * linear.in_features / 32 * 2 ** -24 * magnitude
    assert ((ours - reference).abs() <= bound).all()


def test_a_w4a8_layer_stays_within_4_bit_rounding_of_the_float_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    x = torch.randn(5, 256)
    with torch.inference_mode():
        ours = w4a8.W4A8Linear.quantize(linear)(x).float()
        reference = linear(x)
    assert (ours - reference).abs().max() < 0.1 * reference.abs().max()


def test_every_row_of_a_w4a8_forward_gets_its_one_row_bits_whatever_the_row_count():
    torch.manual_seed(0)
    layer = w4a8.W4A8Linear.quantize(torch.nn.Linear(8960, 48, bias=False))
    rows = torch.randn(2 * w4a8.MAX_ROWS + 3, 8960).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(rows[i:i + 1]) for i in range(len(rows))])
        for n in (*range(2, w4a8.MAX_ROWS + 1), len(rows)):  # a prompt runs in several calls
            assert torch.equal(layer(rows[:n]), alone[:n])


def test_layers_the_kernel_cannot_tile_and_the_output_layer_keep_8_bits():
    from backends.torch.layer_choice import quantize_linear
    from backends.torch.quantized_linear import Int8Linear, W8A8Linear

    eight_bit = (Int8Linear, W8A8Linear)
    assert isinstance(quantize_linear(torch.nn.Linear(64, 40), "w4a8", is_head=False),
                      eight_bit)  # 40 outputs: not a whole number of 16-row tiles
    assert isinstance(quantize_linear(torch.nn.Linear(48, 64), "w4a8", is_head=False),
                      eight_bit)  # 48 inputs: not a whole number of 32-input groups
    assert isinstance(quantize_linear(torch.nn.Linear(64, 48), "w4a8", is_head=True), eight_bit)
    assert isinstance(quantize_linear(torch.nn.Linear(64, 48), "w4a8", is_head=False),
                      w4a8.W4A8Linear)


def test_w4a8_is_refused_with_the_fix_where_its_kernel_cannot_run(monkeypatch):
    monkeypatch.setattr(w4a8, "is_available", lambda: False)
    monkeypatch.setattr(w4a8, "unavailable_reason", lambda: "this CPU lacks AVX512-VNNI")
    with pytest.raises(SpecdeckError, match="AVX512-VNNI.*--dtype int4"):
        torch_backend.resolve_dtype("w4a8", "cpu")
    with pytest.raises(SpecdeckError, match="CPU only"):
        torch_backend.resolve_dtype("w4a8", "cuda")


def test_a_w4a8_draft_model_drafts_from_a_4_bit_output_layer_and_the_output_stays_plain(
        tmp_path):
    from app.core.engine import SpecEngine
    from app.core.types import SamplingParams
    from app.drafters.draft_model import DraftModelDrafter
    from backends.torch.backend import TorchBackend
    from backends.torch.quantized_linear import W8A8Linear
    from tests.tiny import save_hf_folder, tiny_llama

    folder = save_hf_folder(tiny_llama(seed=1), tmp_path / "tiny")
    target = TorchBackend().load(str(folder), device="cpu", dtype="w4a8")
    draft = TorchBackend().load(str(folder), device="cpu", dtype="w4a8")
    prompt, params = [5, 9, 12, 5, 9, 3, 7, 5, 9], SamplingParams(max_new_tokens=30)
    plain = list(SpecEngine(target).generate(prompt, params))[-1]
    for vocab_limit in (0, 16):  # 16: rows of the 8-bit layer the 4-bit one was made from
        drafter = DraftModelDrafter(target, draft, vocab_limit=vocab_limit)
        assert isinstance(drafter._session.head, w4a8.W4A8Linear)
        assert isinstance(draft.hf.get_output_embeddings(), W8A8Linear)  # the model keeps its own
        done = list(SpecEngine(target, drafter, k=3).generate(prompt, params))[-1]
        assert done.token_ids == plain.token_ids and done.stats.accepted > 0
    assert DraftModelDrafter(target, target)._session.head is None  # drafting for itself: 8 bits
