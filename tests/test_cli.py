"""`specdeck generate`: the --json contract, and bad input as one clear line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import main
from tests.conftest import tiny_llama

CONTRACT = {"text", "token_ids", "n_new_tokens", "decode_tok_s", "ttft_s", "target_forwards",
            "drafted", "accepted", "acceptance_rate", "mean_accepted_length",
            "accepted_per_position", "drafter", "k", "backend", "device", "dtype"}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    model = tiny_llama(seed=1)
    model.hf.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    return folder


def generate(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_output_carries_the_contract_fields(tiny_folder, capsys):
    code, out, _ = generate(capsys, "--target", str(tiny_folder), "--prompt", "w5 w9 w12 w5 w9",
                            "--drafter", "ngram", "--k", "3", "--max-new-tokens", "12", "--json")
    assert code == 0
    result = json.loads(out)
    assert CONTRACT <= result.keys()
    assert result["n_new_tokens"] == len(result["token_ids"]) == 12
    assert result["drafter"] == "ngram" and result["k"] == 3 and result["backend"] == "torch"


def test_draft_model_output_equals_plain_output(tiny_folder, capsys):
    common = ["--target", str(tiny_folder), "--prompt", "w3 w4 w5", "--max-new-tokens", "16",
              "--json"]
    plain = json.loads(generate(capsys, *common, "--drafter", "none")[1])
    spec = json.loads(generate(capsys, *common, "--drafter", "draft", "--draft",
                               str(tiny_folder))[1])
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["acceptance_rate"] == 1.0 and plain["mean_accepted_length"] == 1.0


BAD = [
    (["--prompt-file", "/nonexistent/prompt.txt"], "prompt file not found"),
    (["--prompt", "w1", "--k", "-1"], "--k must be >= 0"),
    (["--prompt", "w1", "--temperature", "-0.5"], "temperature must be >= 0"),
    (["--prompt", "w1", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt", "w1", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt", " ".join(["w7"] * 300)], "takes at most 256"),
    (["--prompt", "w1", "--drafter", "draft"], "needs --draft"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_clear_line_and_exit_2(tiny_folder, capsys, args, message):
    code, out, err = generate(capsys, "--target", str(tiny_folder), *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_target_names_the_fix(capsys):
    code, _, err = generate(capsys, "--target", "/nonexistent/model.gguf", "--prompt", "hi")
    assert code == 2 and "specdeck pull" in err
