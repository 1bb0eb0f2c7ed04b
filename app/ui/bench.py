"""The Bench tab: run `specdeck bench` on the loaded models from the page, plot the results.

Knows: app.bench.run's run_bench / load_prompts / BenchSettings and its report (the JSON
contract), where each pair's last report is kept (SPECDECK_HOME/bench/ui/PAIR.json, the pair
recorded in it; SPECDECK_HOME/bench/ui-last.json from before, matched by its target), that
the drafters offered are those the Workbench can run on the loaded pair (`why_not`), and
that the tab follows a pair switch (`BenchTab.follow`). Must not know: how the benchmark
measures (app/bench/run.py owns that), which drafter needs what (the Workbench owns that),
array libraries.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from app.paths import home
from app.runtime import compute
from app.ui.chat import k_control, notice
from app.ui.inputs import BENCH_LIMIT, BENCH_MAX_NEW, parse_k, whole
from app.ui.render import refusal
from app.ui.workbench import DRAFTER_CHOICES, Busy, Workbench

CLI_HINT = ("From a terminal: `specdeck bench --target MODEL [--draft DRAFT] --drafters "
            "ngram,draft --prompts spec-bench --limit 2 --json report.json --plot speedup.png`")
COLUMNS = ("config", "decode tok/s", "speedup", "τ", "acceptance", "identical")
KINDS = tuple(c for c in DRAFTER_CHOICES if c != "none")  # plain always runs
DEFAULT_KIND = "ngram"


@dataclass(frozen=True)
class PairKey:
    """The loaded models as a saved report records them: the catalogue pair (None for local
    files), the target's and draft model's names, the head folder's name."""

    pair: str | None
    target: str
    draft: str | None = None
    head: str | None = None

    @classmethod
    def of(cls, bench: Workbench) -> PairKey | None:
        if not bench.loaded:
            return None
        return cls(bench.pair_id, bench.target.name, getattr(bench.draft, "name", None),
                   Path(bench.head).name if bench.head else None)

    @property
    def label(self) -> str:
        return self.pair or " + ".join(n for n in (self.target, self.draft, self.head) if n)

    def path(self) -> Path:
        return home() / "bench" / "ui" / (re.sub(r"[^\w.+-]", "_", self.label) + ".json")

    def recorded_in(self, report: dict[str, Any]) -> bool:
        """Whether report measured these models (the name of a file is no proof)."""
        if "pair" in report:
            return report["pair"] == asdict(self)
        # a report saved before reports named their pair: its target and draft model
        settings = report.get("settings") or {}
        return (self.head is None
                and (settings.get("target"), settings.get("draft")) == (self.target, self.draft))


def legacy_report_path() -> Path:
    """Where the tab kept one report for whatever was loaded, before reports named a pair."""
    return home() / "bench" / "ui-last.json"


def read_last_report(key: PairKey | None) -> dict[str, Any] | None:
    """The last report of these models, or None (nothing loaded, or no run of them yet)."""
    if key is None:
        return None
    for path in (key.path(), legacy_report_path()):
        report = _read(path)
        if report is not None and key.recorded_in(report):
            return report
    return None


def _read(path: Path) -> dict[str, Any] | None:
    try:
        report = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


@dataclass(frozen=True)
class Offer:
    """The drafter kinds the loaded pair can run, and each other kind with why it cannot."""

    runnable: tuple[str, ...] = ()
    unavailable: tuple[tuple[str, str], ...] = ()

    def keep(self, chosen: list[str] | None) -> list[str]:
        """The chosen kinds this pair runs; the default when none of them does."""
        kept = [c for c in chosen or () if c in self.runnable]
        if kept:
            return kept
        return [DEFAULT_KIND] if DEFAULT_KIND in self.runnable else list(self.runnable[:1])


def drafter_offer(bench: Workbench) -> Offer:
    """Split the bench's drafter kinds by the Workbench's own check (`resolve`, the one chat
    and race refuse a kind by), so the tab offers nothing that would fail when run."""
    if not bench.loaded:
        return Offer()
    reasons = {kind: bench.why_not(kind) for kind in KINDS}
    return Offer(tuple(k for k, why in reasons.items() if not why),
                 tuple((k, why) for k, why in reasons.items() if why))


def unavailable_markdown(offer: Offer, loaded: bool) -> str:
    if not loaded:
        return "Load a pair in the **Models** tab: the drafters it can run are offered here."
    if not offer.unavailable:
        return ""
    return "Not for this pair:\n" + "\n".join(f"- **{kind}** — {why}"
                                                for kind, why in offer.unavailable)


def report_frames(report: dict[str, Any] | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(table, long-form plot data) of a bench report: one row per available configuration."""
    rows, plot = [], []
    for c in (report or {}).get("configs", []):
        o = c.get("overall")
        if not c.get("available") or not o:
            continue
        identical = {None: "-", True: "yes", False: "no"}[o.get("identical")]
        rows.append((c["name"], _num(o.get("decode_tok_s")), _num(o.get("speedup_median")),
                     _num(o.get("tau")), _num(o.get("acceptance_rate")), identical))
        plot += [{"config": c["name"], "metric": "decode tok/s", "value": o.get("decode_tok_s")
                  or 0.0}, {"config": c["name"], "metric": "τ", "value": o.get("tau") or 0.0}]
    return (pd.DataFrame(rows, columns=list(COLUMNS)),
            pd.DataFrame(plot, columns=["config", "metric", "value"]))


def _num(value: Any) -> float | None:
    return None if value is None else round(float(value), 2)


def summary_markdown(report: dict[str, Any] | None, key: PairKey | None = None) -> str:
    if not report and key is not None:
        return (f"No bench run for this pair yet ({key.label}). Press **Run benchmark** to "
                f"measure it. {CLI_HINT}")
    if not report:
        return (f"No benchmark run yet. Load a pair in the **Models** tab, then press **Run "
                f"benchmark**. {CLI_HINT}")
    s = report.get("settings", {})
    m = report.get("machine", {})
    return (f"**{s.get('target')}**" + (f" + draft {s['draft']}" if s.get("draft") else "")
            + f" · {s.get('n_prompts')} prompts · {s.get('max_new_tokens')} new tokens · "
            f"temperature {s.get('temperature')} · {m.get('cpu', '')} "
            f"({m.get('device', '')} {m.get('dtype', '')})")


class BenchHandlers:
    def __init__(self, bench: Workbench) -> None:
        self.bench = bench

    def view(self, chosen: list[str] | None = None) -> tuple:
        """(drafters, unavailable, summary, table, tok/s plot, τ plot) of the loaded pair: its
        runnable drafters (the chosen ones kept where it runs them) and its last report."""
        key = PairKey.of(self.bench)
        offer = drafter_offer(self.bench)
        report = read_last_report(key)
        table, plot = report_frames(report)
        return (gr.CheckboxGroup(choices=list(offer.runnable), value=offer.keep(chosen)),
                unavailable_markdown(offer, key is not None), summary_markdown(report, key),
                table, _metric(plot, "decode tok/s"), _metric(plot, "τ"))

    def run(self, prompts: str, limit: float, max_new_tokens: float, drafters: list[str],
            k: str | int) -> Iterator[tuple]:
        """Yield (log, summary, table, tok/s plot, τ plot, notice) while the benchmark runs."""
        from app.bench import run as benchmark
        from app.bench.prompts import load_prompts
        from app.bench.settings import BenchSettings

        if not self.bench.loaded:
            yield _skip(notice("no model is loaded: load one in the Models tab first"))
            return
        if not drafters:
            yield _skip(notice("pick at least one drafter to compare with plain decoding"))
            return
        try:
            settings = BenchSettings(drafters=tuple(drafters), ks=(parse_k(k),),
                                     max_new_tokens=whole(max_new_tokens, BENCH_MAX_NEW),
                                     head=self.bench.head)
            chosen = load_prompts(prompts, whole(limit, BENCH_LIMIT))
        except Exception as error:  # noqa: BLE001 - shown in the page; nothing was taken
            yield _skip(notice(refusal(error)))
            return
        yield from self._run(benchmark, chosen, settings)

    def _run(self, benchmark: Any, prompts: list, settings: Any) -> Iterator[tuple]:
        lines: queue.Queue[str] = queue.Queue()
        result: dict[str, Any] = {}
        key = PairKey.of(self.bench)  # a load waits for the run: the pair stays this one

        def work() -> None:
            # the worker holds the model, not the page: a closed tab ends this generator, but
            # the run goes on and no chat may interleave with it until it ends
            try:
                with self.bench.hold():
                    result["report"] = compute.call(
                        benchmark.run_bench, self.bench.pair, prompts, settings,
                        log=lines.put)
            except Busy as error:
                result["busy"] = str(error)
            except Exception as error:  # noqa: BLE001 - shown in the page, the app stays up
                result["error"] = refusal(error)

        started = time.perf_counter()
        worker = threading.Thread(target=work, name="specdeck-bench", daemon=True)
        worker.start()
        log: list[str] = []
        while worker.is_alive() or not lines.empty():
            try:
                log.append(lines.get(timeout=0.5))
            except queue.Empty:
                continue
            yield _skip(gr.skip(), log="\n".join(log[-200:]))
        if "busy" in result:
            yield _skip(notice(result["busy"]))
            return
        if "error" in result:
            yield _skip(notice(f"the benchmark failed: {result['error']}"), log="\n".join(log))
            return
        report = {**result["report"], "pair": asdict(key)}
        log.append(f"finished in {time.perf_counter() - started:.0f} s; " + _save(report, key))
        table, plot = report_frames(report)
        yield ("\n".join(log), summary_markdown(report, key), table, _metric(plot, "decode tok/s"),
               _metric(plot, "τ"), notice(""))


def _metric(plot: pd.DataFrame, metric: str) -> pd.DataFrame:
    return plot[plot["metric"] == metric].reset_index(drop=True)


def _skip(message: Any, log: Any = None) -> tuple:
    return (gr.skip() if log is None else log, gr.skip(), gr.skip(), gr.skip(), gr.skip(),
            message)


def _save(report: dict[str, Any], key: PairKey) -> str:
    """Keep the report as this pair's last, for the next start of the app; say where it went."""
    path = key.path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, ensure_ascii=False), encoding="utf-8")
    except OSError as error:
        return f"the report could not be saved ({error})"
    return f"report saved to {path}"


@dataclass(frozen=True)
class BenchTab:
    """The built tab, for the page to refresh after an event that changed the loaded models."""

    view: Callable[..., tuple] | None = None  # None: the placeholder, nothing to refresh
    inputs: tuple = ()
    outputs: tuple = ()

    def follow(self, trigger: Callable[..., Any]) -> None:
        """Refresh the tab on trigger (an event's `then`, the page's `load`)."""
        if self.view is not None:
            trigger(self.view, list(self.inputs), list(self.outputs), queue=False)


def build_bench_tab(bench: Workbench) -> BenchTab:
    """Lay out the Bench tab; without app.bench.run it says how to run the CLI."""
    try:
        from app.bench.prompts import PROMPT_SETS
    except ImportError:
        gr.Markdown(f"The benchmark is not part of this build yet. {CLI_HINT}",
                    elem_id="bench-placeholder")
        return BenchTab()
    handlers = BenchHandlers(bench)
    offered, unavailable_text, summary_text, table, tok_s_data, tau_data = handlers.view(
        [DEFAULT_KIND])
    gr.Markdown("Plain and speculative decoding, interleaved prompt by prompt on this machine; "
                "every speedup is a ratio between runs made moments apart. The run holds the "
                "model: chat and race wait until it ends.")
    bench_notice = gr.HTML("", elem_id="bench-notice")
    with gr.Row():
        prompts = gr.Dropdown(list(PROMPT_SETS), value="humaneval",
                              allow_custom_value=True, label="Prompts (set or JSONL path)")
        limit = gr.Slider(BENCH_LIMIT.low, BENCH_LIMIT.high, value=1, step=1,
                          label=BENCH_LIMIT.label, elem_id="bench-limit")
        max_new = gr.Slider(16, BENCH_MAX_NEW.high, value=64, step=16, label=BENCH_MAX_NEW.label,
                            elem_id="bench-max-new")
        with gr.Column():
            drafters = gr.CheckboxGroup(offered.choices, value=offered.value,
                                        label="Drafters (plain always runs)",
                                        elem_id="bench-drafters")
            unavailable = gr.Markdown(unavailable_text, elem_id="bench-unavailable")
        k = k_control(bench.default_k, "bench-k")
    run = gr.Button("Run benchmark", variant="primary", elem_id="bench-run")
    summary = gr.Markdown(summary_text, elem_id="bench-summary")
    results = gr.Dataframe(table, label="Results (median over prompts)", elem_id="bench-table",
                           interactive=False)
    with gr.Row():
        tok_s = gr.BarPlot(tok_s_data, x="config", y="value", y_lim=[0, None],
                           title="decode tok/s", elem_id="bench-tok-s")
        tau = gr.BarPlot(tau_data, x="config", y="value", y_lim=[0, None],
                         title="τ (tokens per target forward)", elem_id="bench-tau")
    log = gr.Textbox(label="Log", lines=6, max_lines=12, elem_id="bench-log")
    run.click(handlers.run, [prompts, limit, max_new, drafters, k],
              [log, summary, results, tok_s, tau, bench_notice], concurrency_id="model",
              concurrency_limit=1)
    return BenchTab(handlers.view, (drafters,), (drafters, unavailable, summary, results, tok_s,
                                                 tau))
