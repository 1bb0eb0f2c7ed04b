"""scripts/apple_check.sh works the first time on a Mac: every step it can is run here on MLX's
CPU build (the pull finds tiny models installed under the default pair's ids), and the
script keeps to what macOS ships (bash 3.2, no coreutils). Also bench's two pieces it drives:
`--drafters all` and `--verify-cost`."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.verify_cost import format_costs, parse_rows, verify_costs
from app.core.types import SpecdeckError

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "apple_check.sh"
MLX_WITH_A_DRAFT_MODEL = ("ngram", "ngram-tree", "draft", "chain", "lookahead", "suffix")


def run_script(env: dict[str, str], tmp_path: Path) -> tuple[int, dict, str]:
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PY": sys.executable, "TOKENS": "16",
                                 "LIMIT": "1", "TMPDIR": str(tmp_path), **env})
    return result.returncode, json.loads(result.stdout.splitlines()[-1]), result.stdout


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["pull", "local folders"])
def test_apple_check_benches_every_kind_mlx_runs_and_the_verify_cost_of_1_to_9_rows(
        tmp_path, mode):
    pytest.importorskip("mlx_lm")
    from app.catalogue.registry import load_catalogue
    from tests.installed import install_tiny

    pair = load_catalogue().pair(load_catalogue().default_pair)
    assert "mlx" in pair.backends  # the pair a Mac pulls has MLX sources
    home = tmp_path / "home"
    target = install_tiny(home, pair.target.id, backend="mlx")
    draft = install_tiny(home, pair.drafter.id, seed=2, backend="mlx")
    env = {"SPECDECK_HOME": str(home)}
    if mode == "local folders":
        env |= {"APPLE_CHECK_TARGET": str(target), "APPLE_CHECK_DRAFT": str(draft)}
    rc, line, stdout = run_script(env, tmp_path)
    assert (rc, line["ok"], line["schema"]) == (0, True, "specdeck.apple_check/1"), stdout
    assert line["model"] == (pair.id if mode == "pull" else f"{target} + draft {draft}")
    assert line["machine"]["backend"] == "mlx"
    assert list(line["results"]) == ["plain", *(f"{k} k=4" for k in MLX_WITH_A_DRAFT_MODEL)]
    assert all(r["identical"] for r in line["results"].values())
    assert line["verify_cost"]["rows"] == list(range(1, 10))
    assert all(ms > 0 for ms in line["verify_cost"]["median_ms"])
    assert "plain: " in stdout and "verify ms by rows: 1: " in stdout
    assert not list(tmp_path.glob("apple_check.*"))  # its work folder is removed


def test_apple_check_without_mlx_says_so_in_one_json_line(tmp_path):
    python = tmp_path / "python"  # a python that cannot import mlx
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S -I \"$@\"\n")
    python.chmod(0o755)
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PY": str(python), "TMPDIR": str(tmp_path)})
    line = json.loads(result.stdout.splitlines()[-1])
    assert (result.returncode, line["ok"], line["step"]) == (1, False, "mlx")
    assert "pip install -e '.[mlx]'" in line["error"]


def test_apple_check_keeps_to_what_macos_ships():
    text = SCRIPT.read_text()
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    assert os.access(SCRIPT, os.X_OK)
    # bash 3.2: no associative arrays, mapfile, case changes, |& or &>>; no coreutils timeout
    for construct in (r"declare -A", r"\bmapfile\b", r"\breadarray\b", r"\$\{\w+(,,|\^\^)",
                      r"\|&", r"&>>", r"^\s*timeout\b", r"\btimeout \"?\$", r"\bgtimeout\b"):
        assert not re.search(construct, text, re.MULTILINE), construct
    assert "--backend mlx" in text and "--drafters all" in text and "--verify-cost" in text


# ---- the bench pieces it drives ------------------------------------------------------------


def test_bench_drafters_all_are_the_kinds_check_lets_run_on_mlx_with_what_is_given(tmp_path):
    from app.bench.cli import _usable_kinds
    from tests.serving import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny")  # no MTP layers in its config
    args = argparse.Namespace(backend="mlx", pair=None, head=None)
    assert _usable_kinds(args, str(folder), str(folder), ("all",)) == MLX_WITH_A_DRAFT_MODEL
    assert _usable_kinds(args, str(folder), None, ("none", "all")) == \
        ("none", "ngram", "ngram-tree", "lookahead", "suffix")
    head = argparse.Namespace(backend="torch", pair=None, head=str(folder))
    assert {"eagle3", "eagle3:tree", "lookup+eagle3", "medusa", "dflash"} <= \
        set(_usable_kinds(head, str(folder), None, ("all",)))


def test_verify_cost_times_each_row_count_after_a_96_token_prompt(target):
    costs = verify_costs(target, (1, 2, 9), rounds=2)
    assert costs["rows"] == [1, 2, 9] and costs["rounds"] == 2
    assert costs["prompt_tokens"] == 96 and costs["vs_one_row"][0] == 1.0
    assert all(ms > 0 for ms in costs["median_ms"])
    assert format_costs(costs).startswith("verify cost (ms by rows, after 96 tokens): 1: ")


def test_verify_cost_rows_are_read_as_a_range_or_a_list():
    assert parse_rows("1-9") == tuple(range(1, 10))
    assert parse_rows("1,2,4") == (1, 2, 4)
    for bad in ("0-3", "a-b", "", "1,,2"):
        with pytest.raises(SpecdeckError, match="--verify-cost"):
            parse_rows(bad)
