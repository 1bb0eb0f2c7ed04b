"""A random EAGLE-3 head on SmolLM2-135M (the real model the tests fetch): speculative greedy
output, chain and tree, equals plain output in the dtypes specdeck runs on CPU."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from tests.eagle_heads import write_head

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def run_json(capsys, gguf, *args: str) -> dict:
    code = main(["generate", "--target", str(gguf), "--chat", "--prompt", PROMPT,
                 "--max-new-tokens", "40", "--json", *args])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_head_on_smollm2_keeps_greedy_output_equal_to_plain(smollm2_gguf, tmp_path, capsys,
                                                              dtype):
    # SmolLM2-135M: hidden 576, 30 layers, vocabulary 49152
    head = write_head(tmp_path / "head", "midlayer", hidden=576, vocab=49152, n_layers=30,
                      seed=0, draft_vocab=4096, scale=0.05)
    plain = run_json(capsys, smollm2_gguf, "--drafter", "none", "--dtype", dtype)
    chain = run_json(capsys, smollm2_gguf, "--drafter", "eagle3", "--draft", str(head),
                     "--k", "4", "--dtype", dtype)
    tree = run_json(capsys, smollm2_gguf, "--drafter", "eagle3", "--draft", str(head),
                    "--k", "4", "--tree", "--dtype", dtype)
    assert plain["n_new_tokens"] > 10
    assert chain["token_ids"] == plain["token_ids"] == tree["token_ids"]
    assert chain["drafted"] > 0 and tree["drafted"] > 0
