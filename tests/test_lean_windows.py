"""The lean CPU forward (backends/torch/decoder.py) computes sliding-window targets: a windowed
Mistral and Gemma 3 (norms after each sublayer, 1 + w norms, GELU, one RoPE per layer type)
get transformers' bits on every row of every forward a session runs past the window, their
windows hold their last tokens rather than the context, a rewind past what a window kept
replays, and a GGUF file of them takes the C steps to its source's logits."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig  # noqa: E402

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends.torch import gguf_model, lean_ops  # noqa: E402
from backends.torch.backend import TorchBackend, TorchModel  # noqa: E402
from backends.torch.decoder import lean_reason  # noqa: E402
from backends.torch.static_kv import SPARE  # noqa: E402
from tests.test_engine import oracle  # noqa: E402
from tests.tiny import (  # noqa: E402
    VOCAB,
    W4A8,
    lean_and_reference,
    same_rows,
    save_gguf,
    tiny_tokenizer,
)
from tests.tiny_families import WINDOW, tiny_family  # noqa: E402

# widths the C steps take (multiples of 16): tiny_families' 32-wide models keep the torch steps
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=1,
             bos_token_id=0, pad_token_id=0, tie_word_embeddings=False, sliding_window=WINDOW)
DTYPES = ["float32", "int8", "int4", W4A8]


def _config(family: str):
    if family == "gemma3_text":
        return Gemma3TextConfig(**SHAPE, num_hidden_layers=4, query_pre_attn_scalar=16,
                                layer_types=["sliding_attention"] * 3 + ["full_attention"])
    return MistralConfig(**SHAPE, num_hidden_layers=2)


def _wide(family: str) -> TorchModel:
    torch.manual_seed(2)
    hf = AutoModelForCausalLM.from_config(_config(family)).to(torch.float32)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
        for name, weight in hf.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's start at 0: make a lost 1 + w count
                weight.uniform_(-0.5, 0.5)
    return TorchModel(hf, tiny_tokenizer(), name=f"wide-{family}", device="cpu")


def _ids(n: int, seed: int) -> list[int]:
    return [(seed + 7 * i * i) % (VOCAB - 2) + 2 for i in range(n)]


def _saved(family: str, folder) -> str:
    source = tiny_family(family, seed=2)
    source.hf.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_lean_forward_gives_windowed_rows_the_bits_of_the_transformers_forward(
        tmp_path, family, dtype):
    model = TorchBackend().load(_saved(family, tmp_path / family), device="cpu", dtype=dtype)
    lean, reference = sessions = lean_and_reference(model)

    def both(ids, **kwargs):
        same_rows(sessions, ids, (0, 1), **kwargs)

    both(_ids(70, 1), n_logits=3)  # a first prompt past the row-wise limit: one masked call
    for token in range(12):
        both([5 + token])  # plain decoding steps, each window sliding by a token
    both(_ids(6, 3), n_logits=6)  # a chain verify
    for session in (lean, reference):
        session.rewind(session.length - 4)
    for chunk in range(4):  # later prompts: the window's slots slide
        both(_ids(60, chunk), n_logits=2)
    for session in (lean, reference):  # past what the window kept: the lean cache replays
        session.rewind(session.length - SPARE - 2 * WINDOW)
    both([9, 10], n_logits=2)
    assert lean.tokens == reference.tokens


def test_a_sliding_window_holds_its_last_tokens_and_full_layers_the_context(tmp_path):
    model = TorchBackend().load(_saved("gemma3_text", tmp_path / "g"), device="cpu",
                                dtype="float32")
    session = model.start()
    for chunk in range(8):
        session.forward(_ids(60, chunk))
    cache = session._static
    window_keys, _, offset = cache.layer(0)  # a sliding layer
    full_keys, _, full_offset = cache.layer(3)
    assert offset > 0 and window_keys.shape[1] == WINDOW + 2 * SPARE
    assert full_offset == 0 and full_keys.shape[1] >= session.length


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_a_windowed_gguf_on_the_c_steps_computes_what_its_source_computes(tmp_path, family):
    if gguf_model.unavailable_reason() is not None or not lean_ops.is_available():
        pytest.skip("no GGUF or lean_ops kernel here")
    source = _wide(family)
    model = TorchBackend().load(str(save_gguf(source, tmp_path / "model.gguf", int(T.F32))),
                                device="cpu", dtype="gguf")
    assert model.lean is not None and model.lean.in_c
    prompt = _ids(3 * WINDOW, 5)
    ours = torch.as_tensor(model.start().forward(prompt, n_logits=len(prompt)).host_logits())
    theirs = torch.as_tensor(source.start().forward(prompt, n_logits=len(prompt)).host_logits())
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-5
    model.eos_token_ids = frozenset()
    params = SamplingParams(max_new_tokens=3 * WINDOW)
    plain = list(list(SpecEngine(model).generate(prompt, params))[-1].token_ids)
    assert plain == oracle(model, prompt, 3 * WINDOW)
    drafter = build_drafter("ngram", model, backend=TorchBackend())
    done = list(SpecEngine(model).generate(prompt, params, drafter=drafter, k=4))[-1]
    assert list(done.token_ids) == plain


def test_targets_the_lean_forward_does_not_compute_say_why():
    capped = _config("gemma3_text")
    capped.final_logit_softcapping = 30.0  # Gemma 2's way: the forward here has no cap
    assert "caps its logits" in lean_reason(AutoModelForCausalLM.from_config(capped))
    assert "not a Llama-style" in lean_reason(tiny_family("qwen3_5_text").hf)
    assert lean_reason(tiny_family("gemma3_text").hf) == "its projections are not fused"
