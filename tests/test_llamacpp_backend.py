"""The llama.cpp backend (`--backend llamacpp`) on the real SmolLM2-135M GGUF: speculative greedy
output equals plain output on llama.cpp's own kernels, verifies stay within the block size the
load check found exact, and what llama.cpp cannot run is refused naming the fix.

Needs llama-cpp-python (`make llamacpp` compiles it); skipped where it is not installed."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from app.cli import main  # noqa: E402
from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from backends import load_backend  # noqa: E402
from backends.llamacpp.backend import MAX_BLOCK  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    return load_backend("llamacpp").load(str(smollm2_gguf))


def run_json(capsys, gguf, *args: str) -> dict:
    code = main(["generate", "--target", str(gguf), "--backend", "llamacpp", "--chat",
                 "--prompt", PROMPT, "--max-new-tokens", "48", "--json", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_ngram_and_self_draft_on_llamacpp_produce_exactly_the_plain_tokens(smollm2_gguf, capsys):
    plain = run_json(capsys, smollm2_gguf, "--drafter", "none")
    ngram = run_json(capsys, smollm2_gguf, "--drafter", "ngram", "--k", "4")
    draft = run_json(capsys, smollm2_gguf, "--drafter", "draft", "--draft", str(smollm2_gguf),
                     "--k", "4")
    assert plain["backend"] == "llamacpp" and plain["n_new_tokens"] > 10
    assert ngram["token_ids"] == plain["token_ids"]
    assert draft["token_ids"] == plain["token_ids"]
    assert draft["acceptance_rate"] == 1.0 and draft["mean_accepted_length"] > 3.0


def test_the_llamacpp_tokens_are_the_torch_backends_tokens(smollm2_gguf, capsys):
    """One GGUF, two engines, the same tokenizer and the same greedy text start."""
    on_llama = run_json(capsys, smollm2_gguf, "--drafter", "none")
    code = main(["generate", "--target", str(smollm2_gguf), "--backend", "torch", "--chat",
                 "--prompt", PROMPT, "--max-new-tokens", "8", "--json", "--drafter", "none",
                 "--dtype", "float32"])
    on_torch = json.loads(capsys.readouterr().out)
    assert code == 0
    assert on_llama["n_prompt_tokens"] == on_torch["n_prompt_tokens"]
    assert on_llama["token_ids"][:3] == on_torch["token_ids"][:3]


def test_each_verify_row_has_the_bits_of_decoding_it_alone(model):
    """The load check's claim, re-measured through the session: rows of a k + 1 verify (split
    into the checked block size) equal the same tokens decoded one by one."""
    assert 1 <= model.row_block <= MAX_BLOCK
    prompt = model.tokenizer.encode("def fibonacci(n):")
    tail = [int(t) for t in np.random.default_rng(0).integers(100, 20000, size=MAX_BLOCK)]
    one = model.start()
    one.forward(prompt)
    alone = np.stack([one.forward([t]).host_logits()[0] for t in tail])
    batched = model.start()
    batched.forward(prompt)
    rows = batched.forward(tail, n_logits=len(tail)).host_logits()
    assert np.array_equal(rows, alone)
    batched.rewind(len(prompt) + 2)
    assert batched.tokens == (*prompt, *tail[:2])
    assert np.array_equal(batched.forward(tail[2:3]).host_logits()[0], alone[2])


def test_sampled_speculation_on_llamacpp_runs_through_the_same_pipeline(model):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=24)
    prompt = model.tokenizer.encode("Once upon a time")
    from app import drafters
    drafter = drafters.build_drafter("ngram", model)
    out = list(SpecEngine(model, drafter, k=3).generate(prompt, params))[-1]
    assert 0 < len(out.token_ids) <= 24


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_a_head_on_llamacpp_is_refused_naming_the_torch_backend(smollm2_gguf, capsys, tmp_path,
                                                                 kind):
    code = main(["generate", "--target", str(smollm2_gguf), "--backend", "llamacpp",
                 "--drafter", kind, "--draft", str(tmp_path), "--prompt", "hi", "--json"])
    captured = capsys.readouterr()
    assert code != 0
    assert "--backend torch" in captured.err + captured.out


def test_a_file_that_is_not_gguf_is_refused_naming_the_fix(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(SpecdeckError, match="--backend torch"):
        load_backend("llamacpp").load(str(bad))


def test_a_truncated_gguf_is_refused_naming_the_fix(smollm2_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf.read_bytes()[:1 << 20])
    with pytest.raises(SpecdeckError, match="pull --verify"):
        load_backend("llamacpp").load(str(cut))


def test_the_tokenizer_read_from_a_gguf_is_kept_until_the_file_changes(smollm2_gguf, tmp_path):
    import os

    from backends.llamacpp.backend import _tokenizer, tokenizer_path

    gguf = tmp_path / smollm2_gguf.name
    os.symlink(smollm2_gguf, gguf)
    first = _tokenizer(gguf)
    kept = tokenizer_path(gguf)
    assert (kept / "tokenizer_config.json").is_file()
    made = (kept / "tokenizer_config.json").stat().st_mtime_ns
    assert _tokenizer(gguf).encode(PROMPT) == first.encode(PROMPT)
    assert (kept / "tokenizer_config.json").stat().st_mtime_ns == made  # read, not rebuilt
    (kept / ".specdeck-source.json").write_text('{"size": 1, "mtime_ns": 1}')
    _tokenizer(gguf)
    assert (kept / "tokenizer_config.json").stat().st_mtime_ns != made  # the file changed


def test_a_pair_id_on_llamacpp_runs_the_pulled_gguf_with_a_drafter_it_can_run(smollm2_gguf,
                                                                              capsys):
    code = main(["generate", "--target", "smollm2-135m+ngram", "--backend", "llamacpp",
                 "--drafter", "auto", "--prompt", PROMPT, "--max-new-tokens", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["backend"] == "llamacpp" and out["drafter"] == "suffix"  # with history on


def test_bench_runs_llamacpp_beside_torch_each_checked_against_its_own_plain(smollm2_gguf,
                                                                            tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["bench", "--target", str(smollm2_gguf), "--draft", str(smollm2_gguf),
                 "--drafters", "none,ngram,draft", "--k", "3", "--prompts", "humaneval",
                 "--limit", "1", "--max-new-tokens", "16", "--warmup", "0",
                 "--compare-backend", "llamacpp", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    names = {c["name"]: c for c in report["configs"] if c["available"]}
    assert {"plain", "draft k=3", "llamacpp:plain", "llamacpp:ngram k=3",
            "llamacpp:draft k=3"} <= set(names)
    for name in ("ngram k=3", "draft k=3", "llamacpp:ngram k=3", "llamacpp:draft k=3"):
        assert names[name]["overall"]["identical"] is True, name
