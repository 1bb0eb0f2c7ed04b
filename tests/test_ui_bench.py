"""The Bench tab follows the loaded pair (issue 35, item 6): its own last report, the drafters
it can run, and every other kind shown with why not. Scripted models, no downloaded weights."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from app.core.protocols import Capabilities
from app.ui import build_app
from app.ui.bench import BenchHandlers, PairKey, drafter_offer, legacy_report_path
from app.ui.workbench import Choice, Workbench
from tests.test_ui import FakeTarget

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # gr.Warning outside a request

QWEN, SMOL = "qwen2.5-coder-1.5b+0.5b", "smollm2-135m+eagle3"
# what the Qwen pair (a target and its draft model, no head, no MTP layers) runs
QWEN_RUNS = ["auto", "ngram", "ngram-tree", "draft", "chain", "lookahead", "suffix"]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def saved_runs(monkeypatch):
    """app.bench.run.run_bench replaced by one that reports the pair's target it was given;
    records the settings of each run."""
    from app.bench import run as benchmark

    seen: list = []

    def run_bench(pair, prompts, settings, log=print):
        seen.append(settings)
        target, draft = pair.target, pair.draft
        return {"settings": {"target": target.name, "draft": getattr(draft, "name", None)},
                "machine": {}, "configs": [
                    {"name": f"{target.name} ngram k=4", "available": True, "overall": {
                        "decode_tok_s": 20.0, "speedup_median": 2.0, "tau": 2.5,
                        "acceptance_rate": 0.5, "identical": True}}]}

    monkeypatch.setattr(benchmark, "run_bench", run_bench)
    return seen


def model(name: str) -> FakeTarget:
    target = FakeTarget()
    target.name = name
    return target


def load_qwen(bench: Workbench) -> Workbench:
    bench.attach(model("Qwen2.5-Coder-1.5B"), draft=model("Qwen2.5-Coder-0.5B"),
                 label="Qwen coder", pair_id=QWEN, auto_kind=Choice("draft", "the pair's"))
    return bench


def load_smol(bench: Workbench) -> Workbench:
    """SmolLM2 with its EAGLE-3 head, as Models loads a pair that ships a head."""
    bench.attach(model("SmolLM2-135M"), label="SmolLM2", pair_id=SMOL,
                 auto_kind=Choice("eagle3", "the pair's"))
    bench.head, bench.head_kind = "/models/eagle3-smollm2-135m", "eagle3"
    return bench


def run(bench: Workbench) -> tuple:
    return list(BenchHandlers(bench).run("humaneval", 1, 16, ["ngram"], 4))[-1]


def shown(bench: Workbench) -> tuple:
    """(offered kinds, chosen, unavailable text, summary, table rows) the tab shows now."""
    drafters, unavailable, summary, table, _, _ = BenchHandlers(bench).view(["ngram"])
    return ([value for _, value in drafters.choices], drafters.value, unavailable, summary,
            table.values.tolist())


# ---------------------------------------------------------------- the pair's own report


def test_the_tab_shows_the_loaded_pairs_report_and_not_another_pairs(saved_runs):
    bench = load_smol(Workbench())
    run(bench)
    load_qwen(bench)
    _, _, _, summary, rows = shown(bench)
    assert f"No bench run for this pair yet ({QWEN})" in summary and rows == []
    run(bench)
    load_smol(bench)  # back to SmolLM2: its own report, not the Qwen run made since
    _, _, _, summary, rows = shown(bench)
    assert "**SmolLM2-135M**" in summary and rows[0][0] == "SmolLM2-135M ngram k=4"
    load_qwen(bench)
    _, _, _, summary, rows = shown(bench)
    assert "**Qwen2.5-Coder-1.5B**" in summary and rows[0][0] == "Qwen2.5-Coder-1.5B ngram k=4"


def test_a_report_saved_before_reports_named_their_pair_shows_only_for_its_target():
    report = {"settings": {"target": "SmolLM2-135M", "draft": None}, "configs": []}
    legacy_report_path().parent.mkdir(parents=True)
    legacy_report_path().write_text(json.dumps(report))
    bench = Workbench()
    bench.attach(model("SmolLM2-135M"), pair_id="smollm2-135m+ngram")
    assert "**SmolLM2-135M**" in shown(bench)[3]
    assert "No bench run for this pair yet" in shown(load_qwen(bench))[3]


def test_a_run_saves_the_pair_it_measured_and_runs_the_pairs_head(saved_runs):
    bench = load_smol(Workbench())
    run(bench)
    saved = json.loads(PairKey.of(bench).path().read_text())
    assert saved["pair"] == {"pair": SMOL, "target": "SmolLM2-135M", "draft": None,
                             "head": "eagle3-smollm2-135m"}
    assert saved_runs[-1].head == "/models/eagle3-smollm2-135m"


def test_with_nothing_loaded_the_tab_offers_nothing_and_says_where_to_load():
    offered, chosen, unavailable, summary, rows = shown(Workbench())
    assert (offered, chosen, rows) == ([], [], [])
    assert "Models" in unavailable and "Load a pair" in summary


# ---------------------------------------------------------------- the drafters offered


def test_the_qwen_pair_is_offered_exactly_the_kinds_it_runs_and_shown_why_not_the_heads():
    offered, chosen, unavailable, _, _ = shown(load_qwen(Workbench()))
    assert offered == QWEN_RUNS and chosen == ["ngram"]
    for kind in ("eagle3", "eagle3:tree", "eagle", "lookup+eagle3", "medusa", "dflash"):
        assert f"- **{kind}** — drafter {kind!r} needs its head" in unavailable
    assert "- **mtp** — drafter 'mtp' needs MTP layers in the target's own checkpoint, and " \
           "Qwen2.5-Coder-1.5B has none" in unavailable


def test_a_pair_with_an_eagle3_head_is_offered_that_head_and_not_the_other_heads():
    offer = drafter_offer(load_smol(Workbench()))
    assert offer.runnable == ("auto", "ngram", "ngram-tree", "eagle3", "eagle3:tree",
                              "lookup+eagle3", "lookahead", "suffix")
    why = dict(offer.unavailable)
    assert why["medusa"] == ("drafter 'medusa' needs a medusa head, and this pair's head is "
                             "eagle3: pick eagle3")
    assert "needs a draft model" in why["draft"]


def test_a_target_with_mtp_layers_is_offered_mtp():
    bench = load_qwen(Workbench())
    bench.mtp_layers = 1
    assert "mtp" in drafter_offer(bench).runnable


def test_mlx_and_a_logits_only_target_are_not_offered_the_kinds_they_cannot_run():
    bench = load_smol(Workbench())
    bench.backend = SimpleNamespace(name="mlx")
    assert "medusa" in dict(drafter_offer(bench).unavailable)  # not the pair's head anyway
    bench.head_kind = "medusa"  # Medusa runs on MLX
    assert "medusa" in drafter_offer(bench).runnable
    bench.head_kind = "dflash"  # DFlash runs on MLX
    assert "dflash" in drafter_offer(bench).runnable
    bench = load_smol(Workbench())
    bench.backend = SimpleNamespace(name="llamacpp")
    bench.target.capabilities = Capabilities(hidden_states=False)
    why = dict(drafter_offer(bench).unavailable)
    assert "reads the target's hidden states" in why["eagle3"]
    assert "ngram" in drafter_offer(bench).runnable


def test_switching_pair_keeps_the_chosen_drafters_the_new_pair_runs():
    bench = load_qwen(Workbench())
    drafters = BenchHandlers(bench).view(["draft", "chain", "lookahead"])[0]
    assert drafters.value == ["draft", "chain", "lookahead"]
    load_smol(bench)
    drafters = BenchHandlers(bench).view(["draft", "chain", "lookahead"])[0]
    assert drafters.value == ["lookahead"]
    assert BenchHandlers(bench).view(["draft"])[0].value == ["ngram"]


# ---------------------------------------------------------------- the page


def component(demo, elem_id: str):
    return next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == elem_id)


def test_the_built_page_offers_the_loaded_pairs_drafters_and_its_empty_state():
    demo = build_app(load_qwen(Workbench()))
    assert [value for _, value in component(demo, "bench-drafters").choices] == QWEN_RUNS
    assert "**medusa** — drafter 'medusa' needs its head" in component(
        demo, "bench-unavailable").value
    assert "No bench run for this pair yet" in component(demo, "bench-summary").value


def test_the_tab_refreshes_after_each_load_delete_and_page_open():
    demo = build_app(load_qwen(Workbench()))
    fns = list(demo.fns.values())
    follows = {f.trigger_after for f in fns if getattr(f.fn, "__name__", "") == "view"}
    loads = {i for i, f in demo.fns.items() if getattr(f.fn, "__name__", "") in
             ("load", "load_files", "delete")}
    assert len(loads) == 3 and loads <= follows
    opened = [f for f in fns if getattr(f.fn, "__name__", "") == "view"
              and f.targets[0][1] == "load"]
    assert [o.elem_id for o in opened[0].outputs][:3] == ["bench-drafters", "bench-unavailable",
                                                         "bench-summary"]
