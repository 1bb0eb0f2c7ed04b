"""The Bench tab: run `specdeck bench` on the loaded models from the page, plot the results.

Knows: app.bench.run's run_bench / load_prompts / BenchSettings and its report (the JSON
contract), where the last report is kept (SPECDECK_HOME/bench/ui-last.json). Must not know:
how the benchmark measures (app/bench/run.py owns that), array libraries.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from app.ui.chat import k_control, notice
from app.ui.inputs import BENCH_LIMIT, BENCH_MAX_NEW, parse_k, whole
from app.ui.render import refusal
from app.ui.workbench import DRAFTER_CHOICES, Busy, Workbench

CLI_HINT = ("From a terminal: `specdeck bench --target MODEL [--draft DRAFT] --drafters "
            "ngram,draft --prompts spec-bench --limit 2 --json report.json --plot speedup.png`")
COLUMNS = ("config", "decode tok/s", "speedup", "τ", "acceptance", "identical")


def last_report_path() -> Path:
    home = Path(os.environ.get("SPECDECK_HOME", Path.home() / ".cache" / "specdeck"))
    return home / "bench" / "ui-last.json"


def read_last_report() -> dict[str, Any] | None:
    path = last_report_path()
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None


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


def summary_markdown(report: dict[str, Any] | None) -> str:
    if not report:
        return (f"No benchmark run yet. Press **Run benchmark** to measure the loaded model. "
                f"{CLI_HINT}")
    s = report.get("settings", {})
    m = report.get("machine", {})
    return (f"**{s.get('target')}**" + (f" + draft {s['draft']}" if s.get("draft") else "")
            + f" · {s.get('n_prompts')} prompts · {s.get('max_new_tokens')} new tokens · "
            f"temperature {s.get('temperature')} · {m.get('cpu', '')} "
            f"({m.get('device', '')} {m.get('dtype', '')})")


class BenchHandlers:
    def __init__(self, bench: Workbench) -> None:
        self.bench = bench

    def run(self, prompts: str, limit: float, max_new_tokens: float, drafters: list[str],
            k: str | int) -> Iterator[tuple]:
        """Yield (log, summary, table, tok/s plot, τ plot, notice) while the benchmark runs."""
        from app.bench import run as benchmark

        if not self.bench.loaded:
            yield _skip(notice("no model is loaded: load one in the Models tab first"))
            return
        if not drafters:
            yield _skip(notice("pick at least one drafter to compare with plain decoding"))
            return
        try:
            settings = benchmark.BenchSettings(drafters=tuple(drafters), ks=(parse_k(k),),
                                               max_new_tokens=whole(max_new_tokens,
                                                                    BENCH_MAX_NEW))
            chosen = benchmark.load_prompts(prompts, whole(limit, BENCH_LIMIT))
        except Exception as error:  # noqa: BLE001 - shown in the page; nothing was taken
            yield _skip(notice(refusal(error)))
            return
        yield from self._run(benchmark, chosen, settings)

    def _run(self, benchmark: Any, prompts: list, settings: Any) -> Iterator[tuple]:
        lines: queue.Queue[str] = queue.Queue()
        result: dict[str, Any] = {}

        def work() -> None:
            # the worker holds the model, not the page: a closed tab ends this generator, but
            # the run goes on and no chat may interleave with it until it ends
            try:
                with self.bench.hold():
                    result["report"] = benchmark.run_bench(
                        self.bench.target, prompts, settings, backend=self.bench.backend,
                        draft=self.bench.draft, log=lines.put)
            except Busy as error:
                result["busy"] = str(error)
            except Exception as error:  # noqa: BLE001 - shown in the page, the app stays up
                result["error"] = refusal(error)

        started = time.perf_counter()
        worker = threading.Thread(target=work, daemon=True)
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
        report = result["report"]
        log.append(f"finished in {time.perf_counter() - started:.0f} s; " + _save(report))
        table, plot = report_frames(report)
        yield ("\n".join(log), summary_markdown(report), table, _metric(plot, "decode tok/s"),
               _metric(plot, "τ"), notice(""))


def _metric(plot: pd.DataFrame, metric: str) -> pd.DataFrame:
    return plot[plot["metric"] == metric].reset_index(drop=True)


def _skip(message: Any, log: Any = None) -> tuple:
    return (gr.skip() if log is None else log, gr.skip(), gr.skip(), gr.skip(), gr.skip(),
            message)


def _save(report: dict[str, Any]) -> str:
    """Keep the report for the next start of the app; say where it went."""
    path = last_report_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, ensure_ascii=False), encoding="utf-8")
    except OSError as error:
        return f"the report could not be saved ({error})"
    return f"report saved to {path}"


def build_bench_tab(bench: Workbench) -> None:
    """Lay out the Bench tab; without app.bench.run it says how to run the CLI."""
    try:
        from app.bench import run as benchmark
    except ImportError:
        gr.Markdown(f"The benchmark is not part of this build yet. {CLI_HINT}",
                    elem_id="bench-placeholder")
        return
    handlers = BenchHandlers(bench)
    report = read_last_report()
    table, plot = report_frames(report)
    gr.Markdown("Plain and speculative decoding, interleaved prompt by prompt on this machine; "
                "every speedup is a ratio between runs made moments apart. The run holds the "
                "model: chat and race wait until it ends.")
    bench_notice = gr.HTML("", elem_id="bench-notice")
    with gr.Row():
        prompts = gr.Dropdown(list(benchmark.PROMPT_SETS), value="humaneval",
                              allow_custom_value=True, label="Prompts (set or JSONL path)")
        limit = gr.Slider(BENCH_LIMIT.low, BENCH_LIMIT.high, value=1, step=1,
                          label=BENCH_LIMIT.label, elem_id="bench-limit")
        max_new = gr.Slider(16, BENCH_MAX_NEW.high, value=64, step=16, label=BENCH_MAX_NEW.label,
                            elem_id="bench-max-new")
        drafters = gr.CheckboxGroup([c for c in DRAFTER_CHOICES if c != "none"],
                                    value=["ngram"],
                                    label="Drafters (plain always runs)")
        k = k_control(bench.default_k, "bench-k")
    run = gr.Button("Run benchmark", variant="primary", elem_id="bench-run")
    summary = gr.Markdown(summary_markdown(report), elem_id="bench-summary")
    results = gr.Dataframe(table, label="Results (median over prompts)", elem_id="bench-table",
                           interactive=False)
    with gr.Row():
        tok_s = gr.BarPlot(_metric(plot, "decode tok/s"), x="config", y="value", y_lim=[0, None],
                           title="decode tok/s", elem_id="bench-tok-s")
        tau = gr.BarPlot(_metric(plot, "τ"), x="config", y="value", y_lim=[0, None],
                         title="τ (tokens per target forward)", elem_id="bench-tau")
    log = gr.Textbox(label="Log", lines=6, max_lines=12, elem_id="bench-log")
    run.click(handlers.run, [prompts, limit, max_new, drafters, k],
              [log, summary, results, tok_s, tau, bench_notice], concurrency_id="model",
              concurrency_limit=1)
