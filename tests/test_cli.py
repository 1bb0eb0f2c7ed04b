"""`specdeck generate`: the --json contract, and bad input as one clear line with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main
from tests.tiny import tiny_llama

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
    (["--prompt", "w1", "--k", "-1"], "k must be an integer from 0 to"),
    (["--prompt", "w1", "--temperature", "-0.5"], "temperature must be >= 0"),
    (["--prompt", "w1", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt", "w1", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt", " ".join(["w7"] * 300)], "takes at most 256"),
    (["--prompt", "w1", "--drafter", "draft"], "needs a draft model: give --draft PATH"),
    (["--prompt", "w1", "--seed", "-1"], "--seed must be in 0..2**64-1"),
    (["--prompt", "w1", "--seed", str(2**64)], "--seed must be in 0..2**64-1"),
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


@pytest.mark.parametrize("content", [bytes(range(256)) * 4, b"w5 w9\x00\x00 w12"],
                         ids=["not-utf8", "nul-bytes"])
def test_a_binary_prompt_file_is_one_clear_line(tiny_folder, capsys, tmp_path, content):
    path = tmp_path / "prompt.bin"
    path.write_bytes(content)
    code, _, err = generate(capsys, "--target", str(tiny_folder), "--prompt-file", str(path))
    assert code == 2 and "give a text file" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_specdeck_home_that_is_a_file_names_the_fix(capsys, tmp_path, monkeypatch):
    import app.cli
    from app.paths import home

    def uses_home(_args) -> int:  # what pull does first with the home folder
        home().mkdir(parents=True, exist_ok=True)
        return 0

    home_file = tmp_path / "home"
    home_file.write_text("not a folder")
    monkeypatch.setenv("SPECDECK_HOME", str(home_file))
    monkeypatch.setattr(app.cli, "_generate", uses_home)
    code, _, err = generate(capsys, "--prompt", "w1")
    assert code == 2
    assert f"SPECDECK_HOME={home_file} is a file" in err and "set SPECDECK_HOME" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_output_piped_to_a_reader_that_leaves_ends_quietly(tiny_folder):
    root = Path(__file__).resolve().parent.parent
    process = subprocess.Popen(
        [sys.executable, "-m", "app", "generate", "--target", str(tiny_folder), "--prompt",
         "w5 w9 w12 w5 w9", "--max-new-tokens", "20", "--json"], cwd=root,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    # like `| head -c 0`: the reader leaves before the one --json write, so it always fails
    process.stdout.close()
    err = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err
