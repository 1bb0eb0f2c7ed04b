"""The lean CPU forward (backends/torch/decoder.py) computes Gemma 4's dense text decoder, in
the 31B's shape: full layers with wider heads and one key head whose projection is also the
values (attention_k_eq_v, fused as q/k), per-head q/k norms and a scale-free value norm,
attention scaled by 1, a scalar on each layer's output, a partial RoPE on the full layers,
capped final logits. Its rows get transformers' bits past the sliding window in float32,
int8 and int4, speculation gives plain decoding's tokens, and the Gemma 4 features it does
not compute (per-layer inputs, MoE blocks, shared keys and values, attention both ways) are
refused by name."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM, Gemma4TextConfig  # noqa: E402

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from backends.torch.decoder import lean_reason  # noqa: E402
from tests.test_engine import oracle  # noqa: E402
from tests.tiny import VOCAB, lean_and_reference, same_rows, tiny_tokenizer  # noqa: E402
from tests.tiny_families import WINDOW  # noqa: E402

# the 31B's config, narrowed: sliding layers of 2 key heads 16 wide, full layers of 1 key head
# 32 wide whose keys are the values, a final cap of 30, image tokens (none here) both ways
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, global_head_dim=32, attention_k_eq_v=True,
             num_global_key_value_heads=1, sliding_window=WINDOW, final_logit_softcapping=30.0,
             use_bidirectional_attention="vision", hidden_size_per_layer_input=0,
             vocab_size_per_layer_input=0, max_position_embeddings=512, eos_token_id=1,
             bos_token_id=0, pad_token_id=0, tie_word_embeddings=False, num_hidden_layers=4,
             layer_types=["sliding_attention", "full_attention"] * 2)
DTYPES = ["float32", "int8", "int4"]


def _model(**overrides):
    torch.manual_seed(4)
    hf = AutoModelForCausalLM.from_config(Gemma4TextConfig(**{**SHAPE, **overrides}))
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # sharper logits: greedy tokens vary with the context
        for name, weight in hf.named_parameters():
            if name.endswith("norm.weight"):  # Gemma 4's scale by w: start away from 1
                weight.uniform_(0.5, 1.5)
        for index, layer in enumerate(hf.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.2 * index)
    return hf.to(torch.float32)


def _saved(folder) -> str:
    _model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def _ids(n: int, seed: int) -> list[int]:
    return [(seed + 7 * i * i) % (VOCAB - 2) + 2 for i in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_lean_forward_gives_gemma_4_rows_the_bits_of_the_transformers_forward(
        tmp_path, dtype):
    model = TorchBackend().load(_saved(tmp_path / "gemma4"), device="cpu", dtype=dtype)
    lean, reference = sessions = lean_and_reference(model)

    def both(ids, **kwargs):
        same_rows(sessions, ids, (0, 1, 3), **kwargs)

    both(_ids(70, 1), n_logits=3)  # a first prompt past the row-wise limit: one masked call
    for token in range(8):
        both([5 + token])  # plain decoding steps, each window sliding by a token
    both(_ids(6, 3), n_logits=6)  # a chain verify
    for session in (lean, reference):
        session.rewind(session.length - 4)
    for chunk in range(3):  # later prompts: the window's slots slide
        both(_ids(40, chunk), n_logits=2)
    kept = lean._static.offset(WINDOW)
    assert kept > 0
    # below what the window kept the lean cache replays, computing rows in blocks: float32's
    # one-row kernel rounds unlike a block's (TorchModel.check_exactness), so float32 goes
    # back only as far as the window holds
    back = kept + WINDOW if dtype == "float32" else kept - 1
    for session in (lean, reference):
        session.rewind(back)
    both([9, 10], n_logits=2)
    assert lean.tokens == reference.tokens
    sliding, _, _ = lean._static.layer(0)
    full, _, _ = lean._static.layer(1)
    assert sliding.shape[0::2] == (2, 16) and full.shape[0::2] == (1, 32)


def test_speculation_on_gemma_4_gives_plain_decodings_tokens(tmp_path):
    model = TorchBackend().load(_saved(tmp_path / "gemma4"), device="cpu", dtype="float32")
    assert model.lean is not None
    model.eos_token_ids = frozenset()
    prompt = _ids(3 * WINDOW, 5)
    params = SamplingParams(max_new_tokens=3 * WINDOW)
    plain = list(list(SpecEngine(model).generate(prompt, params))[-1].token_ids)
    assert plain == oracle(model, prompt, 3 * WINDOW)
    drafter = build_drafter("ngram", model, backend=TorchBackend())
    done = list(SpecEngine(model).generate(prompt, params, drafter=drafter, k=4))[-1]
    assert list(done.token_ids) == plain


@pytest.mark.parametrize(("overrides", "named"), [
    (dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB),
     "hidden_size_per_layer_input"),
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
     "enable_moe_block"),
    (dict(num_kv_shared_layers=2), "num_kv_shared_layers"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
])
def test_gemma_4_features_the_lean_forward_does_not_compute_are_named(overrides, named):
    assert named in lean_reason(_model(**overrides))
