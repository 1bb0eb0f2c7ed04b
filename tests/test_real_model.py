"""SmolLM2-135M-Instruct from the PyPI mirror: speculative greedy output equals plain output."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from backends.torch.backend import cpu_has_native_bf16

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def run_json(capsys, gguf, *args: str) -> dict:
    code = main(["generate", "--target", str(gguf), "--chat", "--prompt", PROMPT,
                 "--max-new-tokens", "48", "--json", *args])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out)


def test_ngram_and_self_draft_produce_exactly_the_plain_tokens(smollm2_gguf, capsys):
    fp32 = ("--dtype", "float32")
    plain = run_json(capsys, smollm2_gguf, "--drafter", "none", *fp32)
    ngram = run_json(capsys, smollm2_gguf, "--drafter", "ngram", "--k", "4", *fp32)
    draft = run_json(capsys, smollm2_gguf, "--drafter", "draft", "--draft", str(smollm2_gguf),
                     "--k", "4", *fp32)
    assert plain["n_new_tokens"] > 10 and plain["text"].strip()
    assert ngram["token_ids"] == plain["token_ids"]
    assert draft["token_ids"] == plain["token_ids"]
    assert draft["acceptance_rate"] == 1.0
    assert draft["mean_accepted_length"] > 3.0


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="the padding was measured on CPUs with "
                    "native bf16 (AVX512-BF16 or AMX); others emulate it on other kernels")
def test_bf16_on_cpu_keeps_speculative_output_equal_to_plain(smollm2_gguf, capsys):
    # padded forwards (backends/torch/backend.py) give bf16 the same numerics for any row count
    plain = run_json(capsys, smollm2_gguf, "--drafter", "none", "--dtype", "bfloat16")
    draft = run_json(capsys, smollm2_gguf, "--drafter", "draft", "--draft", str(smollm2_gguf),
                     "--k", "5", "--dtype", "bfloat16")
    ngram = run_json(capsys, smollm2_gguf, "--drafter", "ngram", "--k", "auto",
                     "--dtype", "bfloat16")
    assert plain["dtype"] == "bfloat16"
    assert draft["token_ids"] == plain["token_ids"] == ngram["token_ids"]


def cpu_dtypes() -> list[str]:
    """Every CPU dtype that loads losslessly here: the file's own blocks where a GGUF kernel
    runs, bf16 where native, w8a8 where VNNI, int4 where its kernel is row-exact, w4a8 where
    its kernel builds and is row-exact."""
    from backends.torch import gguf_model, w4a8
    from backends.torch.quantized_linear import int4_is_available, int4_is_exact, w8a8_is_exact

    return ["float32", "int8"] + (["bfloat16"] if cpu_has_native_bf16() else []) \
        + (["w8a8"] if w8a8_is_exact() else []) \
        + (["int4"] if int4_is_available() and int4_is_exact() else []) \
        + (["w4a8"] if w4a8.is_exact() else []) \
        + (["gguf"] if gguf_model.unavailable_reason() is None else [])


@pytest.mark.parametrize("dtype", cpu_dtypes())
def test_large_k_keeps_speculative_output_equal_to_plain_in_every_cpu_dtype(smollm2_gguf,
                                                                            dtype):
    # the target drafting for itself accepts long runs, so verifies reach k + 1 rows
    from app.core.engine import SpecEngine, last_done
    from app.core.prompt import chat_ids
    from app.core.types import SamplingParams
    from app.drafters import build_drafter
    from backends.torch.backend import TorchBackend

    backend = TorchBackend()
    target = backend.load(str(smollm2_gguf), device="cpu", dtype=dtype)
    engine = SpecEngine(target)
    prompt = chat_ids(target.tokenizer, [{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_new_tokens=64)

    def tokens(drafter, k: int) -> tuple[int, ...]:
        done = last_done(engine.generate(prompt, params, drafter=drafter, k=k))
        assert done.error is None
        return done.token_ids

    plain = tokens(None, 1)
    # one loaded model serves as both: the drafter runs its own (inexact) session
    drafter = build_drafter("draft", target, backend=backend, draft=target)
    for k in (1, 8, 16, 32):
        assert tokens(drafter, k) == plain, (dtype, k)
