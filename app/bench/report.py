"""The bench report's faces: the machine it names, the human table, the one-line JSON, the plot.

Knows: the report dict that app/bench/run.py builds (schema specdeck.bench/1). Must not know:
models, engines or how the numbers were measured.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

from app.bench.verify_cost import format_costs
from app.core.types import SpecdeckError

SCHEMA = "specdeck.bench/1"
ALL = "all"  # the category name of the overall row


def machine_info(target: Any, backend: Any = None) -> dict[str, Any]:
    """The machine named in every report: CPU, cores, library versions, backend, device, dtype."""
    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(), "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("torch", "transformers", "mlx", "mlx-lm")
                     if _version(name)},
        "backend": getattr(backend, "name", None) or _backend_of(target),
        "device": target.device, "dtype": target.dtype,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _backend_of(target: Any) -> str:
    return type(target).__module__.rsplit(".", 1)[-1].removesuffix("_backend")


def summary_line(report: dict[str, Any]) -> dict[str, Any]:
    """The one-line JSON that ends stdout: the headline numbers per configuration."""
    m, s = report["machine"], report["settings"]
    results = {}
    for c in report["configs"]:
        o = c["overall"]
        results[c["name"]] = None if o is None else {
            key: o.get(key) for key in ("decode_tok_s", "speedup_median", "speedup_total",
                                        "e2e_speedup_median", "tau", "acceptance_rate",
                                        "overhead_ms_per_step", "speculation_off_steps",
                                        "identical", "speedup_vs_hf_plain",
                                        "speedup_vs_own_plain", "e2e_tok_s")}
    line = {"schema": SCHEMA, "target": s["target"], "draft": s["draft"],
            "n_prompts": s["n_prompts"], "max_new_tokens": s["max_new_tokens"],
            "temperature": s["temperature"],
            "machine": f"{m['cpu']}, {m['cores']} cores, {m['backend']} {m['device']} {m['dtype']}",
            "results": results}
    if report.get("versus"):
        line["versus_llama_cpp"] = report["versus"]
    if report.get("verify_cost"):
        line["verify_cost"] = report["verify_cost"]
    return line


def format_table(report: dict[str, Any]) -> str:
    """The human table: one row per configuration and category (overall first)."""
    m, s = report["machine"], report["settings"]
    head = (f"{s['target']}" + (f" + draft {s['draft']}" if s["draft"] else "")
            + f" | {s['n_prompts']} prompts x {s['repeats']} | {s['max_new_tokens']} new tokens"
            + f" | temperature {s['temperature']} | chat {'on' if s['chat'] else 'off'}\n"
            + f"{m['cpu']} ({m['cores']} cores) | {m['backend']} {m['device']} {m['dtype']} | "
            + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
            + f" | peak memory {report['peak_memory_bytes'] / 2**30:.2f} GiB")
    cols = ("config", "category", "n", "tok/s", "speedup", "sp.total", "e2e tok/s", "e2e sp.",
            "τ", "accept", "draft/verify/other s", "ovh ms/step", "identical")
    rows = []
    for c in report["configs"]:
        if not c["available"]:
            continue
        parts = [(ALL, c["overall"])]
        if len(c["categories"]) > 1:
            parts += list(c["categories"].items())
        rows += [_table_row(c["name"], category, o) for category, o in parts]
    widths = [max(len(r[i]) for r in (cols, *rows)) for i in range(len(cols))]
    lines = [head, "  ".join(h.ljust(w) for h, w in zip(cols, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    available = [c for c in report["configs"] if c["available"]]
    per_position = [f"{c['name']}: " + " ".join(f"{a:.2f}" for a in
                                                c["overall"]["acceptance_per_position"])
                    + _off_note(c["overall"])
                    for c in available if c["overall"]["acceptance_per_position"]]
    if per_position:
        lines.append("acceptance per position: " + "; ".join(per_position))
    hf = [f"{c['name']} {c['overall']['speedup_vs_hf_plain'] or 0:.2f}x"
          for c in available if c["drafter"] in ("hf-assisted", "hf-prompt-lookup")]
    if hf:
        lines.append("HF transformers, speedup vs its own plain generate (median): "
                     + ", ".join(hf))
    lines += _versus_lines(report.get("versus"))
    lines += [f"unavailable: {c['name']}: {c['reason']}"
              for c in report["configs"] if not c["available"]]
    if report.get("verify_cost"):
        lines.append(format_costs(report["verify_cost"]))
    return "\n".join(lines)


def _versus_lines(versus: dict[str, Any] | None) -> list[str]:
    """specdeck against llama.cpp, same run: median of same-prompt tok/s ratios."""
    if not versus:
        return []

    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    return [f"specdeck vs llama.cpp, {which} ({v['specdeck']} / {v['llama.cpp']}, "
            f"{v['n_prompts']} prompts): e2e {x(v['e2e_ratio'])}, decode {x(v['decode_ratio'])}"
            for which, v in versus.items()]


def _off_note(o: dict[str, Any]) -> str:
    off = o["speculation_off_steps"]
    return f" (speculation off in {off} of {o['steps']} steps)" if off else ""


def _table_row(name: str, category: str, o: dict[str, Any]) -> tuple[str, ...]:
    def f(value: Any, spec: str = ".2f", suffix: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{suffix}"

    split = ("-" if o["draft_s"] is None else
             f"{o['draft_s']:.2f}/{o['verify_s']:.2f}/{o['other_s']:.2f}")
    identical = {None: "-", True: "yes", False: "NO " + ",".join(
        f"{k}@{v}" for k, v in list(o["first_divergence"].items())[:3])}[o["identical"]]
    return (name, category, str(o["n_runs"]), f(o["decode_tok_s"]),
            f(o["speedup_median"], suffix="x"), f(o["speedup_total"], suffix="x"),
            f(o["e2e_tok_s"]), f(o["e2e_speedup_median"], suffix="x"), f(o["tau"]),
            f(o["acceptance_rate"], ".0%"), split, f(o["overhead_ms_per_step"]), identical)


def write_plot(report: dict[str, Any], path: str) -> None:
    """Bars of the median speedup versus plain, per configuration and category."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SpecdeckError("--plot needs matplotlib: pip install 'specdeck[bench]'") from error
    configs = [c for c in report["configs"] if c["available"] and c["name"] != "plain"]
    categories = [ALL, *report["settings"]["categories"]] if len(
        report["settings"]["categories"]) > 1 else [ALL]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) * max(len(configs), 1)), 4))
    width = 0.8 / max(len(configs), 1)
    for i, c in enumerate(configs):
        values = [(c["overall"] if cat == ALL else c["categories"][cat])["speedup_median"] or 0
                  for cat in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=c["name"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(configs) - 1) / 2 for x in range(len(categories))],
                  categories)
    ax.set_ylabel("speedup vs plain (median)")
    s, m = report["settings"], report["machine"]
    ax.set_title(f"{s['target']} | {m['cpu']} | {m['device']} {m['dtype']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as error:
        raise SpecdeckError(f"could not write the plot to {path}: {error}") from error
    finally:
        plt.close(fig)
