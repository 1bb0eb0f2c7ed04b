"""`specdeck recipe` prints each engine's current flags, as LANDSCAPE.md documents them.

LANDSCAPE.md (the brief's survey of vLLM, SGLang and llama.cpp) lives in shared/docs beside
the repository; tests/fixtures holds a snapshot for checkouts without it (CI). Every
speculative flag, method, algorithm and type a recipe prints must appear there; the few
server basics it also prints (host, port, tensor parallelism) are
listed here by hand.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from app.catalogue.recipe import Pairing, build, from_catalogue, vllm_speculative_config
from app.cli import main
from app.core.types import SpecdeckError

SHARED_LANDSCAPE = Path(__file__).resolve().parents[2] / "shared" / "docs" / "LANDSCAPE.md"
LANDSCAPE = (SHARED_LANDSCAPE if SHARED_LANDSCAPE.is_file()
             else Path(__file__).parent / "fixtures" / "LANDSCAPE.md")
BASICS = {"--host", "--port", "--tensor-parallel-size", "--tp-size", "--model-path",
          "--enable-metrics", "-m", "-ngl"}
KINDS = ("ngram", "draft", "eagle3", "mtp", "dflash")


@pytest.fixture(scope="module")
def landscape() -> str:
    return LANDSCAPE.read_text(encoding="utf-8")


def pairing(kind: str) -> Pairing:
    return Pairing(name="t", drafter=kind, k=5, target_repo="org/target",
                   target_gguf="target.gguf", draft_repo="org/head", draft_gguf="head.gguf")


def flags(argv: tuple[str, ...]) -> list[str]:
    return [a for a in argv if a.startswith("-") and not a.lstrip("-").isdigit()]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_flag_printed_is_one_landscape_documents(landscape: str, engine: str,
                                                       kind: str) -> None:
    recipe = build(pairing(kind), engine, tp=2)
    undocumented = [f for f in flags(recipe.argv) if f not in BASICS and f not in landscape]
    assert undocumented == []
    values = [recipe.argv[i + 1] for i, a in enumerate(recipe.argv[:-1])
              if a in ("--speculative-algorithm", "--spec-type")]
    assert all(f"`{v}`" in landscape or f" {v}" in landscape for v in values), values


def test_sglang_has_no_medusa_and_says_so() -> None:
    with pytest.raises(SpecdeckError, match="SGLang has no medusa drafter"):
        build(pairing("medusa"), "sglang")


@pytest.mark.parametrize("kind", [*KINDS, "medusa"])
def test_vllm_speculative_config_uses_documented_keys_and_methods(landscape: str,
                                                                  kind: str) -> None:
    config = vllm_speculative_config(pairing(kind))
    assert all(f"`{key}`" in landscape for key in config)
    assert f"`{config['method']}`" in landscape
    assert config["num_speculative_tokens"] == 5
    recipe = build(pairing(kind), "vllm")
    printed = recipe.argv[recipe.argv.index("--speculative-config") + 1]
    assert json.loads(printed) == config


def test_ngram_recipe_keeps_specdecks_lookup_window() -> None:
    assert vllm_speculative_config(pairing("ngram")) == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
        "prompt_lookup_min": 1}


def test_sglang_chain_counts_the_verified_token_among_draft_tokens() -> None:
    argv = build(pairing("draft"), "sglang").argv
    assert argv[argv.index("--speculative-algorithm") + 1] == "STANDALONE"
    assert argv[argv.index("--speculative-num-steps") + 1] == "5"
    assert argv[argv.index("--speculative-eagle-topk") + 1] == "1"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "6"


def test_tensor_parallelism_reaches_each_engine() -> None:
    assert "--tensor-parallel-size" in build(pairing("draft"), "vllm", tp=4).argv
    sglang = build(pairing("draft"), "sglang", tp=4).argv
    assert sglang[sglang.index("--tp-size") + 1] == "4"
    llama = build(pairing("draft"), "llama.cpp", tp=4)
    assert dict(llama.env) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert llama.command.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3 llama-server ")
    assert "--tensor-parallel-size" not in build(pairing("draft"), "vllm").argv


def test_printed_command_parses_back_to_the_same_argv() -> None:
    recipe = build(pairing("draft"), "vllm")
    assert tuple(shlex.split(recipe.command)) == recipe.argv


def test_catalogue_pair_maps_gguf_sources_to_each_engine() -> None:
    pair = from_catalogue("qwen2.5-coder-1.5b+0.5b")
    # vLLM and SGLang load the original checkpoint; the -GGUF repo names it
    assert pair.target_repo == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert pair.draft_repo == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert pair.target_gguf == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    llama = build(pair, "llama.cpp").argv
    assert llama[llama.index("--spec-draft-model") + 1] == pair.draft_gguf


def test_cli_prints_one_json_object_for_a_pair(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", "qwen2.5-coder-1.5b+0.5b", "--engine", "vllm", "--k", "6",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["argv"][:3] == ["vllm", "serve", "Qwen/Qwen2.5-Coder-1.5B-Instruct"]
    config = json.loads(out["argv"][out["argv"].index("--speculative-config") + 1])
    assert config == {"method": "draft_model", "model": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
                      "num_speculative_tokens": 6}
    assert out["base_url"] == "http://127.0.0.1:8000/v1"


def test_cli_takes_a_target_and_draft_without_the_catalogue(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", "--engine", "llama.cpp", "--target", "big.gguf",
                 "--draft", "small.gguf", "--k", "3"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[:3] == ["llama-server", "-m", "big.gguf"]
    assert argv[argv.index("--spec-draft-n-max") + 1] == "3"


@pytest.mark.parametrize("args, message", [
    (["--engine", "llama.cpp", "--target", "org/model"], "needs the target's .gguf"),
    (["--engine", "vllm", "--target", "model.gguf"], "needs the target's hub repo"),
    (["--engine", "vllm", "--target", "org/m", "--drafter", "draft"], "needs --draft"),
    (["--engine", "vllm", "--target", "org/m", "--tp", "0"], "--tp must be >= 1"),
    (["--engine", "vllm"], "give a catalogue pair id"),
    (["no-such-pair", "--engine", "vllm"], "unknown pair 'no-such-pair'"),
    (["qwen3-4b+0.6b", "--engine", "llama.cpp"], "needs the target's .gguf"),
])
def test_impossible_recipes_are_refused_naming_the_fix(
        capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(["recipe", *args]) == 2
    assert message in capsys.readouterr().err
