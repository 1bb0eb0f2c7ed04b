"""The pair seam (app/pair.py): every surface opens its models there, a kind is checked there
with every fact of the loaded pair, and a pair builds each drafter once.

Tiny fp32 HF folders (tests/tiny.py) on the torch backend; seconds on a CPU.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("torch")

from app.core.types import SpecdeckError  # noqa: E402
from app.pair import LoadSpec, Pair  # noqa: E402
from tests.tiny import VOCAB, save_hf_folder, tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pair")
    return {"target": save_hf_folder(tiny_llama(seed=1), base / "target"),
            "draft": save_hf_folder(tiny_llama(seed=2, layers=1), base / "draft"),
            "foreign": save_hf_folder(tiny_llama(seed=3, vocab=VOCAB + 8), base / "foreign")}


def spec(folders: dict[str, Path], draft: str | None = None) -> LoadSpec:
    return LoadSpec(str(folders["target"]), str(folders[draft]) if draft else None,
                    backend="torch", device="cpu", dtype="float32")


def test_a_pair_builds_each_drafter_once_and_a_stream_slot_gets_its_own(folders):
    pair = Pair.open(spec(folders, "draft"))
    assert pair.draft is not None and pair.target.name != pair.draft.name
    assert pair.drafter("chain") is pair.drafter("chain")
    assert pair.build("chain") is not pair.drafter("chain")


def test_a_kind_the_pair_lacks_is_refused_with_the_fix_before_any_build(folders):
    pair = Pair.open(spec(folders))
    refusal = pair.check("draft")
    assert refusal is not None and "draft model" in refusal.message
    with pytest.raises(SpecdeckError, match="draft model"):
        pair.drafter("draft")
    assert pair.check("ngram") is None


def test_a_draft_with_another_vocabulary_is_refused_when_the_pair_opens(folders):
    with pytest.raises(SpecdeckError, match="does not share the vocabulary"):
        Pair.open(spec(folders, "foreign"))


def test_a_missing_target_names_how_to_get_one():
    with pytest.raises(SpecdeckError, match=r"model not found: /no/such/model.*specdeck pull"):
        Pair.open(LoadSpec("/no/such/model", backend="torch", device="cpu"))


def test_models_are_loaded_only_through_the_pair():
    """No module of app/ but app/pair.py reaches for a backend to load with: the CLI, the
    server, the UI, bench and cache build all open a LoadSpec."""
    loaders = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        if path == ROOT / "app" / "pair.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "backends" and any(
                    alias.name == "load_backend" for alias in node.names):
                loaders.append(str(path.relative_to(ROOT)))
    assert loaders == []


def test_a_pair_holds_one_engine_and_a_lane_beside_it_has_its_own_cache(folders):
    pair = Pair.open(spec(folders))
    pair.history = object()  # any recorder: only the main lane may hold it
    main, beside = pair.engine(), pair.engine("race-plain")
    assert main is pair.engine() and beside is pair.engine("race-plain")
    assert beside.session is not main.session
    assert main.recorder is pair.history and beside.recorder is None


def test_only_the_pair_builds_drafters_and_engines():
    """CLI, server, UI and bench generate on the pair's engine with the pair's drafters: no
    module of app/ but the pair calls the factory or makes an engine (the streams' scheduler
    forks slots from the engine it is handed)."""
    allowed = {"app/pair.py": {"build_drafter", "SpecEngine"},
               "app/runtime/streams.py": {"SpecEngine"}}
    makers = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                called = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if called in {"build_drafter", "SpecEngine"} and \
                        called not in allowed.get(name, set()):
                    makers.append(f"{name}:{node.lineno} {called}")
    assert makers == []
