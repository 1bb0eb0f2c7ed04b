"""The lean CPU forward (backends/torch/decoder.py) computes a Llama-style model bit for bit as
transformers does, through every kind of forward a session runs, in every CPU dtype; models
it does not compute keep transformers' forward."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from backends.torch.backend import TorchBackend, cpu_has_native_bf16
from backends.torch.decoder import lean_reason
from backends.torch.quantized_linear import w8a8_is_exact
from tests.tiny import VOCAB, W4A8, tiny_llama, tiny_tokenizer

BF16 = pytest.param("bfloat16", marks=pytest.mark.skipif(
    not cpu_has_native_bf16(), reason="bf16 runs where the CPU computes it natively"))
W8A8 = pytest.param("w8a8", marks=pytest.mark.skipif(
    not w8a8_is_exact(), reason="this CPU's int8 matmul saturates: specdeck refuses w8a8"))
DTYPES = ["float32", BF16, "int8", W8A8, "int4", W4A8]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             eos_token_id=1, bos_token_id=0)


def _folder(kind: str, tmp_path):
    torch.manual_seed(3)
    if kind == "qwen2":  # q/k/v carry biases
        hf = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    elif kind == "qwen3":  # queries and keys normed per head before RoPE
        hf = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16))
    else:
        hf = LlamaForCausalLM(LlamaConfig(**SHAPE))
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if name.endswith("bias"):
                tensor.normal_(0, 0.5)  # random init leaves them zero: make them count
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                tensor.uniform_(0.5, 1.5)  # ones would hide a norm applied to the wrong rows
    hf.save_pretrained(tmp_path / kind)
    tiny_tokenizer().save_pretrained(tmp_path / kind)
    return tmp_path / kind


def _ids(n: int, seed: int) -> list[int]:
    return [(seed + 7 * i * i) % (VOCAB - 2) + 2 for i in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_lean_forward_gives_every_row_the_bits_of_the_transformers_forward(
        tmp_path, kind, dtype):
    model = TorchBackend().load(str(_folder(kind, tmp_path)), device="cpu", dtype=dtype)
    assert model.lean is not None
    lean = model.start()
    model.lean = None
    reference = model.start()
    layers = (0, 2)

    def both(ids, **kwargs):
        a, b = (s.forward(ids, capture=layers, **kwargs) for s in (lean, reference))
        assert (a.host_logits() == b.host_logits()).all()
        assert a.argmax == b.argmax
        for layer in layers:
            assert torch.equal(a.hidden_states[layer], b.hidden_states[layer])

    both(_ids(70, 1), n_logits=3)  # a first prompt past the row-wise limit: one causal call
    both(_ids(70, 2), n_logits=70)  # a later prompt over the cache
    both([5])
    both(_ids(6, 3), n_logits=6)  # a chain verify
    for session in (lean, reference):
        session.rewind(session.length - 4)
    base = lean.length
    parents = (-1, 0, 0, 1, 1, 2, 4)
    both(_ids(7, 4), n_logits=7, parents=parents)  # a tree verify
    for session in (lean, reference):
        session.keep(base, (0, 1, 4, 6))  # a path: root, its child, that child's, and below
    assert lean.tokens == reference.tokens and lean.length == reference.length
    both([9, 10], n_logits=2)


def test_the_lean_forward_grows_its_cache_past_its_first_allocation(tmp_path):
    model = TorchBackend().load(str(_folder("llama", tmp_path)), device="cpu", dtype="float32")
    lean = model.start()
    model.lean = None
    reference = model.start()
    for chunk in range(9):  # 9 x 60 tokens: over the 512 slots allocated first
        ids = _ids(60, chunk)
        a, b = (s.forward(ids).host_logits() for s in (lean, reference))
        assert (a == b).all()


def test_a_tree_path_is_kept_in_slots_grown_during_a_forward(tmp_path):
    model = TorchBackend().load(str(_folder("llama", tmp_path)), device="cpu", dtype="float32")
    lean = model.start()
    model.lean = None
    reference = model.start()
    for session in (lean, reference):
        for chunk in range(9):  # past the first allocation: the forward grows the slots
            session.forward(_ids(60, chunk))
        base = session.length
        session.forward(_ids(7, 4), n_logits=7, parents=(-1, 0, 0, 1, 1, 2, 4))
        session.keep(base, (0, 2, 5))  # not the first rows: the slots are moved
    a, b = (s.forward([9, 10], n_logits=2).host_logits() for s in (lean, reference))
    assert lean.tokens == reference.tokens and (a == b).all()


def test_models_the_lean_forward_does_not_compute_keep_the_transformers_forward():
    assert lean_reason(tiny_llama(seed=1).hf) == "its projections are not fused"
    gelu_config = LlamaConfig(**SHAPE, hidden_act="gelu")
    assert "activation is gelu" in lean_reason(LlamaForCausalLM(gelu_config))
