"""`specdeck bench --streams`: the verdict table measures N streams at once for every
configuration, and its identity column is a check that can fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.bench import verdict
from app.cli import main
from tests.test_bench import word_prompts, write_jsonl
from tests.tiny import tiny_llama


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    model = tiny_llama(seed=1)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.hf.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    return folder


def test_the_verdict_table_has_a_row_per_configuration_and_count_all_identical_to_solo(
        tiny_folder, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", word_prompts(4))
    out, plot = tmp_path / "verdict.json", tmp_path / "verdict.png"
    code = main(["bench", "--target", str(tiny_folder), "--draft", str(tiny_folder),
                 "--dtype", "bfloat16", "--draft-dtype", "bfloat16",
                 "--drafters", "ngram,draft", "--k", "3", "--streams", "1,3",
                 "--prompts", str(prompts), "--max-new-tokens", "8", "--repeats", "2",
                 "--json", str(out), "--plot", str(plot)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "x solo" in printed and "TPOT p50/p95 ms" in printed
    report = json.loads(out.read_text())
    rows = {(r["config"], r["streams"]): r for r in report["rows"]}
    assert set(rows) == {(c, n) for c in ("plain", "ngram k=3", "draft k=3") for n in (1, 3)}
    for (_, n), row in rows.items():
        assert row["errors"] == 0
        assert row["identical"] == f"{2 * n}/{2 * n}"  # two repeats of n streams each
        assert row["aggregate_tok_s"] > 0 and row["solo_tok_s"] > 0
        assert row["ttft_ms_p50"] <= row["ttft_ms_p95"]
    assert len(report["rounds"]) == 2 * 2 * 3  # repeats x counts x configurations
    assert report["machine"]["cpu"]
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_a_stream_that_parts_from_its_solo_tokens_is_counted_as_not_identical():
    source = verdict.Source()
    source.name, source.family = "plain", "specdeck"
    same = verdict.StreamResult(0, (1, 2, 3), 0.1, 0.3, None)
    other = verdict.StreamResult(1, (4, 5, 7), 0.1, 0.3, None)
    rounds = [verdict.Round("plain", 2, 0, 0.5, (same, other), None)]
    solos = {"specdeck": {0: (1, 2, 3), 1: (4, 5, 6)}}
    row = verdict.table([source], rounds, solos, greedy=True)[0]
    assert row["identical"] == "1/2"
    assert row["aggregate_tok_s"] == pytest.approx(12.0)
    assert row["tpot_ms_p50"] == pytest.approx(100.0)


def test_no_round_meets_a_prompt_another_round_of_its_engine_met():
    prompts = [[i] for i in range(7)]
    used = [[i for i, _ in verdict.assignment(prompts, n, repeat, (1, 2))]
            for repeat in (0, 1) for n in (1, 2)]
    assert used == [[0], [1, 2], [3], [4, 5]]
    assert verdict.prompts_needed((1, 2), 2) == 6
    assert [i for i, _ in verdict.assignment(prompts[:2], 2, 0, (1, 2))] == [1, 0]  # wraps


@pytest.mark.parametrize("counts", ["0", "two", ""])
def test_bad_stream_counts_exit_2_naming_the_fix(tiny_folder, capsys, counts):
    assert main(["bench", "--target", str(tiny_folder), "--streams", counts or ",",
                 "--max-new-tokens", "4"]) == 2
    assert "--streams takes a comma list of counts >= 1" in capsys.readouterr().err


def test_a_specdeck_server_runs_beside_the_local_streams_plain_and_its_default(
        tmp_path, capsys):
    from tests.serving import save_tiny_model, serve_process

    model = save_tiny_model(tmp_path / "tiny")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", word_prompts(3))
    out = tmp_path / "verdict.json"
    with serve_process(["--target", str(model), "--dtype", "bfloat16", "--drafter", "ngram",
                        "--k", "3", "--parallel", "3", "--no-history"],
                       tmp_path / "serve.log") as (_, url):
        code = main(["bench", "--target", str(model), "--dtype", "bfloat16",
                     "--drafters", "none", "--streams", "1,3", "--prompts", str(prompts),
                     "--no-chat", "--max-new-tokens", "8", "--remote", url,
                     "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = {(r["config"], r["streams"]): r for r in json.loads(out.read_text())["rows"]}
    assert {c for c, _ in rows} == {"plain", "remote specdeck:none", "remote specdeck:ngram"}
    for (config, n), row in rows.items():
        assert row["errors"] == 0 and row["identical"] == f"{n}/{n}", (config, n)
    assert rows[("remote specdeck:ngram", 3)]["peak_rss_bytes"] is None  # not our process
