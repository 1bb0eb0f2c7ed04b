"""`specdeck bench` measures what it claims: same-run speedups, identical greedy outputs, a schema.

Tiny random fp32 models make the end-to-end runs take seconds; the SmolLM2 run (slow) checks
the same claims on a real checkpoint with its chat template.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from app.bench import run as bench
from app.bench.prompts import BenchPrompt, load_prompts
from app.bench.records import Record
from app.bench.report import format_table, summary_line
from app.bench.settings import BenchSettings
from app.bench.stats import first_divergence, summarise
from app.cli import main
from app.core.types import SpecdeckError
from app.pair import Pair
from backends.torch.backend import TorchBackend
from tests.tiny import tiny_llama

NUMBER = {"type": "number"}
MAYBE_NUMBER = {"type": ["number", "null"]}
METRICS = {
    "type": "object",
    "required": ["n_runs", "n_errors", "n_prompts", "new_tokens", "decode_tok_s", "e2e_tok_s",
                 "speedup_median", "speedup_total", "e2e_speedup_median", "tau",
                 "acceptance_rate", "acceptance_per_position", "steps", "drafted", "accepted",
                 "speculation_off_steps", "draft_s", "verify_s", "other_s",
                 "overhead_ms_per_step", "peak_memory_bytes",
                 "identical", "first_divergence", "errors", "speedup_vs_hf_plain"],
    "properties": {
        "n_runs": {"type": "integer", "minimum": 1},
        "decode_tok_s": MAYBE_NUMBER, "speedup_median": MAYBE_NUMBER,
        "speedup_total": MAYBE_NUMBER, "tau": MAYBE_NUMBER, "acceptance_rate": MAYBE_NUMBER,
        "acceptance_per_position": {"type": ["array", "null"], "items": NUMBER},
        "draft_s": MAYBE_NUMBER, "verify_s": MAYBE_NUMBER, "other_s": MAYBE_NUMBER,
        "overhead_ms_per_step": MAYBE_NUMBER, "speedup_vs_hf_plain": MAYBE_NUMBER,
        "identical": {"type": ["boolean", "null"]},
        "first_divergence": {"type": "object",
                             "additionalProperties": {"type": "integer", "minimum": 0}},
        "errors": {"type": "array", "items": {"type": "string"}},
    },
}
# the --json contract: other tools (UI bench tab, CI reports) read these names
REPORT_SCHEMA = {
    "type": "object",
    "required": ["schema", "machine", "settings", "peak_memory_bytes", "configs", "runs"],
    "properties": {
        "schema": {"const": "specdeck.bench/1"},
        "machine": {
            "type": "object",
            "required": ["cpu", "cores", "platform", "python", "versions", "backend", "device",
                         "dtype"],
            "properties": {"cpu": {"type": "string", "minLength": 1},
                           "cores": {"type": "integer", "minimum": 1},
                           "versions": {"type": "object", "required": ["torch", "transformers"]},
                           "backend": {"type": "string"}, "device": {"type": "string"},
                           "dtype": {"type": "string"}},
        },
        "settings": {
            "type": "object",
            "required": ["target", "draft", "drafters", "k", "max_new_tokens", "repeats",
                         "temperature", "chat", "compare_hf", "categories", "n_prompts",
                         "skipped_prompts", "target_weights_bytes"],
        },
        "peak_memory_bytes": {"type": "integer", "minimum": 1},
        "configs": {
            "type": "array", "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "drafter", "k", "available", "reason", "overall",
                             "categories"],
                "if": {"properties": {"available": {"const": True}}},
                "then": {"properties": {"overall": METRICS,
                                        "categories": {"additionalProperties": METRICS}}},
                "else": {"properties": {"reason": {"type": "string", "minLength": 1},
                                        "overall": {"type": "null"}}},
            },
        },
        "runs": {
            "type": "array",
            "items": {"type": "object",
                      "required": ["config", "prompt_id", "category", "repeat", "n_new_tokens",
                                   "decode_tok_s", "e2e_tok_s", "total_s", "error", "token_ids",
                                   "stats"]},
        },
    },
}
SUMMARY_SCHEMA = {
    "type": "object",
    "required": ["schema", "target", "draft", "n_prompts", "max_new_tokens", "machine",
                 "results"],
    "properties": {"results": {"type": "object", "required": ["plain"]}},
}


def word_prompts(n: int) -> list[BenchPrompt]:
    """Prompts in the tiny tokenizer's words, two categories, repeating for the n-gram drafter."""
    return [BenchPrompt(f"p{i}", "echo" if i % 2 else "mixed",
                        " ".join(f"w{(i * 7 + j * 3) % 11 + 2}" for j in range(14)))
            for i in range(n)]


def config(report: dict, name: str) -> dict:
    return next(c for c in report["configs"] if c["name"] == name)


@pytest.fixture(scope="module")
def tiny_report(target) -> dict:
    """One run over every drafter kind, with the target as its own draft and HF alongside."""
    settings = BenchSettings(drafters=("none", "ngram", "draft"), ks=(2, -1), max_new_tokens=12,
                             repeats=2, compare_hf=True)
    draft = tiny_llama(seed=1)  # same weights as `target`: must accept every draft token
    return bench.run_bench(Pair.of(TorchBackend(), target, draft), word_prompts(4), settings)


def test_a_second_engines_configurations_are_checked_against_its_own_plain(target):
    """--compare-backend: another engine (here another model standing in for other kernels)
    runs in the same loop under a prefix; its outputs must equal its own plain, not the
    first engine's, and its speedups are against its own plain too."""
    settings = BenchSettings(drafters=("none", "ngram"), ks=(2,), max_new_tokens=10)
    other = tiny_llama(seed=7)
    runners, unavailable = bench.build_runners(Pair.of(TorchBackend(), other), settings,
                                               prefix="other:")
    report = bench.run_bench(Pair.of(TorchBackend(), target), word_prompts(2), settings,
                             extra=runners, extra_unavailable=unavailable)
    names = [c["name"] for c in report["configs"] if c["available"]]
    assert names == ["plain", "ngram k=2", "other:plain", "other:ngram k=2"]
    mine = config(report, "other:ngram k=2")["overall"]
    assert mine["identical"] is True and mine["speedup_vs_own_plain"] is not None
    assert config(report, "other:plain")["overall"]["identical"] is False  # another model
    assert config(report, "ngram k=2")["overall"]["identical"] is True


def test_report_matches_the_written_schema(tiny_report):
    jsonschema.validate(tiny_report, REPORT_SCHEMA)
    jsonschema.validate(summary_line(tiny_report), SUMMARY_SCHEMA)
    json.dumps(tiny_report)  # the whole report is JSON-ready


def test_every_greedy_fp32_output_is_identical_to_plain(tiny_report):
    available = [c for c in tiny_report["configs"] if c["available"]]
    assert {c["name"] for c in available} == {"plain", "ngram k=2", "draft k=2", "hf-plain",
                                              "hf-assisted", "hf-prompt-lookup"}
    for c in available:
        assert c["overall"]["identical"] is True, c["name"]
        assert all(cat["identical"] for cat in c["categories"].values()), c["name"]


def test_plain_and_speculative_runs_interleave_prompt_by_prompt(tiny_report):
    slots = [(r["prompt_id"], r["repeat"]) for r in tiny_report["runs"]]
    n_configs = 6
    # every configuration runs a prompt before any configuration moves to the next one
    assert slots == [slot for slot in dict.fromkeys(slots) for _ in range(n_configs)]
    first, second = ([r["config"] for r in tiny_report["runs"][i:i + n_configs]]
                     for i in (0, n_configs))
    assert second == first[::-1]


def test_target_as_its_own_draft_accepts_every_draft_token(tiny_report):
    o = config(tiny_report, "draft k=2")["overall"]
    assert o["acceptance_rate"] == 1.0
    assert o["acceptance_per_position"] == [1.0, 1.0]
    assert o["tau"] > 2.5  # k + 1 = 3 per step, less where the token limit cuts the last step
    assert o["draft_s"] > 0 and o["verify_s"] > 0 and o["overhead_ms_per_step"] >= 0


def test_per_category_rows_cover_each_category(tiny_report):
    for c in tiny_report["configs"]:
        if c["available"]:
            assert set(c["categories"]) == {"echo", "mixed"}
            assert sum(x["n_runs"] for x in c["categories"].values()) == c["overall"]["n_runs"]


def test_a_k_the_engine_refuses_is_reported_unavailable_not_raised(tiny_report):
    for name in ("ngram k=-1", "draft k=-1"):
        refused = config(tiny_report, name)
        assert refused["available"] is False
        assert "k must be" in refused["reason"] and "-1" in refused["reason"]


def test_table_names_the_machine_and_every_configuration(tiny_report):
    table = format_table(tiny_report)
    assert tiny_report["machine"]["cpu"] in table
    assert "torch cpu float32" in table
    for c in tiny_report["configs"]:
        assert c["name"] in table


@pytest.mark.parametrize("a, b, expected", [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [9, 2, 3], 0),
    ([1, 2, 3, 4, 5], [1, 2, 3, 7, 5], 3),
    ([1, 2, 3], [1, 2, 3, 4], 3),  # one stopped early: they part where the shorter ends
    ([], [5], 0),
])
def test_divergence_reporter_finds_the_first_differing_index(a, b, expected):
    assert first_divergence(a, b) == expected
    assert first_divergence(b, a) == expected


def record(config: str, prompt: str, tokens: tuple[int, ...], tok_s: float,
           decode_s: float = 1.0) -> Record:
    return Record(config, prompt, "c", 0, tokens, tok_s, decode_s, int(tok_s * decode_s),
                  decode_s, None)


def test_speedups_are_same_prompt_ratios_and_divergences_are_named():
    plain = {(p, 0): record("plain", p, (1, 2, 3, 4), s)
             for p, s in (("a", 10.0), ("b", 20.0), ("c", 40.0))}
    spec = [record("x", "a", (1, 2, 3, 4), 30.0), record("x", "b", (1, 2, 9, 4), 20.0),
            record("x", "c", (1, 2, 3, 4), 20.0, decode_s=2.0)]
    out = summarise(spec, plain, greedy=True)
    assert out["speedup_median"] == pytest.approx(1.0)  # ratios 3.0, 1.0, 0.5
    # total tokens over total time: (30 + 20 + 40) / 4 s against (10 + 20 + 40) / 3 s
    assert out["speedup_total"] == pytest.approx((90 / 4) / (70 / 3))
    assert out["identical"] is False
    assert out["first_divergence"] == {"b#0": 2}
    assert summarise(spec, plain, greedy=False)["identical"] is None


def test_bundled_prompt_sets_keep_categories_and_limits():
    spec = load_prompts("spec-bench", limit=1)
    assert [p.category for p in spec] == ["mt_bench", "translation", "summarization", "qa",
                                          "math_reasoning", "rag"]
    humaneval = load_prompts("humaneval", limit=3)
    assert [p.id for p in humaneval] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert humaneval[0].text.startswith("from typing import List")
    coding = load_prompts("mt-bench:coding,math")
    assert {p.category for p in coding} == {"coding", "math"} and len(coding) == 20
    rewrite = load_prompts("humaneval-rewrite", limit=1)[0]
    assert "for idx, elem in enumerate(numbers)" in rewrite.text  # the solution is quoted


def test_unknown_prompt_set_is_refused_with_the_known_names():
    with pytest.raises(SpecdeckError, match="spec-bench, mt-bench, humaneval"):
        load_prompts("nope")
    with pytest.raises(SpecdeckError, match="pick from"):
        load_prompts("humaneval:poetry")


def write_jsonl(path: Path, prompts: list[BenchPrompt]) -> Path:
    path.write_text("".join(json.dumps({"id": p.id, "category": p.category, "prompt": p.text})
                            + "\n" for p in prompts))
    return path


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    model = tiny_llama(seed=1)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.hf.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    return folder


def test_bench_command_runs_end_to_end_and_ends_with_one_json_line(tiny_folder, tmp_path,
                                                                   capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", word_prompts(2))
    out, plot = tmp_path / "report.json", tmp_path / "speedup.png"
    code = main(["bench", "--target", str(tiny_folder), "--draft", str(tiny_folder),
                 "--drafters", "none,ngram,draft", "--k", "3", "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--json", str(out), "--plot", str(plot)])
    assert code == 0
    stdout = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(stdout[-1])
    jsonschema.validate(summary, SUMMARY_SCHEMA)
    assert set(summary["results"]) == {"plain", "ngram k=3", "draft k=3"}
    assert all(r["identical"] for r in summary["results"].values())
    report = json.loads(out.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["settings"]["chat"] is False  # the tiny tokenizer has no chat template
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_a_second_dtype_runs_the_same_configurations_checked_against_its_own_plain(
        tiny_folder, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", word_prompts(2))
    code = main(["bench", "--target", str(tiny_folder), "--draft", str(tiny_folder),
                 "--dtype", "float32", "--compare-dtype", "int8", "--drafters", "draft",
                 "--k", "3", "--prompts", str(prompts), "--max-new-tokens", "8"])
    assert code == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    assert set(results) == {"plain", "draft k=3", "int8:plain", "int8:draft k=3"}
    assert all(r["identical"] for r in results.values())


@pytest.mark.parametrize("flags, message", [
    (["--k", "two"], "--k takes integers"),
    (["--dtype", "int8", "--compare-dtype", "int8"], "the dtype already running"),
    (["--drafters", "ngram,eagle9"], "unknown ['eagle9']"),
    (["--drafters", "draft"], "needs a draft model"),
    (["--prompts", "nope"], "unknown prompt set"),
    (["--chat"], "no chat template"),
])
def test_bad_bench_flags_exit_2_naming_the_fix(tiny_folder, capsys, flags, message):
    assert main(["bench", "--target", str(tiny_folder), "--max-new-tokens", "4", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bench_without_a_model_names_the_flags(capsys):
    assert main(["bench"]) == 2
    assert "--pair" in capsys.readouterr().err


def test_unknown_pair_is_refused_with_the_known_ids(capsys):
    assert main(["bench", "--pair", "no-such-pair"]) == 2
    assert "known pairs are" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_on_smollm2_is_identical_to_plain_for_every_drafter_and_hf(smollm2_gguf, tmp_path,
                                                                         capsys):
    out = tmp_path / "report.json"
    code = main(["bench", "--target", str(smollm2_gguf), "--draft", str(smollm2_gguf),
                 "--drafters", "none,ngram,draft", "--k", "4", "--prompts", "humaneval",
                 "--limit", "2", "--max-new-tokens", "16", "--compare-hf", "--warmup", "0",
                 "--dtype", "float32", "--json", str(out)])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    report = json.loads(out.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["settings"]["chat"] is True  # an instruct model: its chat template is used
    assert set(summary["results"]) == {"plain", "ngram k=4", "draft k=4", "hf-plain",
                                       "hf-assisted", "hf-prompt-lookup"}
    for name, result in summary["results"].items():
        assert result["identical"] is True, name
    assert summary["results"]["draft k=4"]["acceptance_rate"] == 1.0  # its own draft


def test_bench_module_does_not_import_torch():
    # app/ stays array-library free; HF's reference is imported only under --compare-hf
    code = "import sys, app.bench.run; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_bench_by_default_runs_the_planners_choice_against_plain_and_says_why(
        tiny_folder, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", word_prompts(1))
    out = tmp_path / "report.json"
    code = main(["bench", "--target", str(tiny_folder), "--prompts", str(prompts),
                 "--max-new-tokens", "6", "--json", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    # a bare folder has no draft model or head: the planner picks prompt lookup, k per step
    assert set(summary["results"]) == {"plain", "auto:ngram k=auto"}
    report = json.loads(out.read_text())
    assert report["settings"]["auto"][0].startswith("drafter: ngram")
    assert "auto: drafter: ngram" in captured.err
