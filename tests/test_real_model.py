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


@pytest.mark.parametrize("dtype", ["int4", "w8a8"])
def test_quantized_cpu_modes_keep_speculative_output_equal_to_plain(smollm2_gguf, capsys,
                                                                    dtype):
    # fused q/k/v and gate/up projections, quantized, checked row-invariant at load
    plain = run_json(capsys, smollm2_gguf, "--drafter", "none", "--dtype", dtype)
    draft = run_json(capsys, smollm2_gguf, "--drafter", "draft", "--draft", str(smollm2_gguf),
                     "--k", "5", "--dtype", dtype)
    ngram = run_json(capsys, smollm2_gguf, "--drafter", "ngram", "--k", "auto", "--dtype", dtype)
    assert plain["dtype"] == dtype and plain["n_new_tokens"] > 10
    assert draft["token_ids"] == plain["token_ids"] == ngram["token_ids"]
    assert draft["acceptance_rate"] == 1.0
