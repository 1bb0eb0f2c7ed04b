"""The fast tier stays fast: numpy-only test modules collect without torch, and `make check`
deselects every registered marker (each names a need the edit-test loop goes without)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# tests of app.core, the drafters, the catalogue and the wire formats: numpy and fakes only
# (some build torch models in fixtures, which load torch when they run, not at collection)
NUMPY_ONLY = ["test_adaptive", "test_auto_k", "test_draft_model", "test_engine", "test_gguf",
              "test_lookahead", "test_ngram", "test_planner", "test_planner_order",
              "test_prometheus", "test_recipe", "test_registry", "test_sampling",
              "test_stop_rules", "test_tree", "test_verify"]


def test_numpy_only_test_modules_collect_without_torch():
    # a fresh interpreter: this one has imported torch for other tests already
    code = "\n".join(["import sys", "import tests.conftest",
                      *(f"import tests.{name}" for name in NUMPY_ONLY),
                      "print(sorted(m for m in ('torch', 'transformers', 'mlx')"
                      " if m in sys.modules))"])
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_make_check_deselects_every_registered_marker():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^markers = \[(.*?)^\]", pyproject, re.M | re.S).group(1)
    markers = re.findall(r'^\s*"(\w+):', block, re.M)
    assert {"slow", "soak", "browser", "llamacpp", "heavy"} <= set(markers)
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    expression = re.search(r"^CHECK_MARKS := (.*)$", makefile, re.M).group(1)
    assert expression.split(" and ") == [f"not {m}" for m in markers]
