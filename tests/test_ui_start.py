"""`specdeck ui` without --pair/--target starts from what is installed (issue 17, item 1).

The start rule runs against a temporary SPECDECK_HOME with tiny models installed under
catalogue model ids; the background load runs with scripted loads, so the page's header and a
message sent mid-load are checked in milliseconds.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from app.catalogue.registry import load_catalogue
from app.store import recent
from app.ui import model_bar
from app.ui.chat import ChatHandlers
from app.ui.start import StartChoice, StartLoad, choose_start
from tests.installed import install_tiny
from tests.test_ui import scripted_bench, send

SMOL, QWEN, DEFAULT = "smollm2-135m+ngram", "qwen2.5-1.5b+0.5b", "qwen2.5-coder-1.5b+0.5b"
MODELS = {SMOL: ["smollm2-135m-instruct"],
          QWEN: ["qwen2.5-1.5b-instruct", "qwen2.5-0.5b-instruct"],
          DEFAULT: ["qwen2.5-coder-1.5b-instruct-q4km", "qwen2.5-coder-0.5b-instruct-q4km"]}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    return tmp_path


def install(home: Path, *pairs: str) -> None:
    for pair in pairs:
        for model in MODELS[pair]:
            install_tiny(home, model)


def test_the_default_pair_is_the_one_in_the_catalogue_here() -> None:
    assert load_catalogue().default_pair == DEFAULT


def test_the_only_installed_pair_is_loaded(home: Path) -> None:
    install(home, SMOL)
    assert choose_start("torch") == StartChoice(SMOL, "the only installed pair", (SMOL,), DEFAULT)


def test_the_pair_used_last_wins_over_the_default_pair(home: Path) -> None:
    install(home, SMOL, DEFAULT)
    assert choose_start("torch").pair_id == DEFAULT
    assert choose_start("torch").reason == "the default pair"
    recent.remember_pair(SMOL)
    assert (choose_start("torch").pair_id, choose_start("torch").reason) == (SMOL, "used last")


def test_a_pair_used_last_but_since_deleted_is_passed_over(home: Path) -> None:
    install(home, QWEN)
    recent.remember_pair(SMOL)
    assert choose_start("torch").pair_id == QWEN


def test_several_installed_pairs_none_of_them_default_or_used_last_loads_nothing(
        home: Path) -> None:
    install(home, SMOL, QWEN)
    choice = choose_start("torch")
    assert choice.pair_id is None and "2 pairs are installed: pick one in Models" in choice.reason


def test_nothing_installed_loads_nothing_and_names_the_default_download(home: Path) -> None:
    choice = choose_start("torch")
    assert choice.pair_id is None and choice.installed == ()
    assert f"press Download for {DEFAULT}" in choice.reason


def test_a_pair_named_with_pair_is_taken_as_given(home: Path) -> None:
    install(home, SMOL, QWEN)
    assert choose_start("torch", QWEN).reason == "given with --pair"


def test_remembering_survives_an_unwritable_home(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDECK_HOME", str(blocker))  # a file: nothing can be written
    recent.remember_pair(SMOL)
    assert recent.last_pair() is None


# ---- the background load ----------------------------------------------------------------

def scripted_start(fail: bool = False):
    """A Workbench, and a StartLoad whose load waits for `go` and then attaches it."""
    bench, _ = scripted_bench()
    target = bench.target
    bench.unload()
    go = threading.Event()

    def load(bench, pair_id, progress):
        progress("loading the target fake")
        assert go.wait(5)
        if fail:
            raise MemoryError()
        bench.attach(target, label="fake pair", pair_id=pair_id,
                     engines=scripted_bench()[0].pair._new_engine)

    choice = StartChoice(SMOL, "the only installed pair", (SMOL,), DEFAULT)
    return bench, StartLoad(bench, choice, load=load).begin(), go


def test_the_header_shows_the_start_loads_stage_then_the_pair_and_why() -> None:
    bench, start, go = scripted_start()
    assert bench.busy.locked()  # taken when begun: nothing runs on an empty model
    assert f"Loading {SMOL} (the only installed pair): loading the target fake" in model_bar(bench)
    go.set()
    assert start.wait(5) and not bench.busy.locked()
    bar = model_bar(bench)
    assert 'data-loaded="true"' in bar and "loaded at start: the only installed pair" in bar


def test_a_message_sent_while_the_pair_loads_waits_for_it_and_is_answered() -> None:
    bench, start, go = scripted_start()
    frames: list = []
    worker = threading.Thread(target=lambda: frames.extend(send(ChatHandlers(bench), "hi")))
    worker.start()
    worker.join(0.3)
    assert worker.is_alive()  # waiting, not refused with "no model is loaded"
    go.set()
    worker.join(5)
    assert f"waiting for {SMOL} to load" in frames[0][2]
    assert frames[-1][1][-1]["content"] == "Hello world"


def test_a_failed_start_load_says_so_in_the_header_and_frees_the_model() -> None:
    bench, start, go = scripted_start(fail=True)
    go.set()
    assert start.wait(5) and not bench.busy.locked() and not bench.loaded
    assert f"Could not load {SMOL} (the only installed pair): out of memory" in model_bar(bench)
    bench.attach(scripted_bench()[0].target, label="another pair")  # loaded from Models
    assert model_bar(bench).startswith('<div class="sd-model-bar" data-loaded="true">another')
