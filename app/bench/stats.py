"""The bench's statistics: per-configuration medians and ratios against plain, the engine's own
metrics summed over prompts, where outputs diverge, and the report dict (schema
specdeck.bench/1) that app/bench/report.py prints.

Knows: Record and Config (app/bench/records.py), RunStats' fields as dicts.
Must not know: models, engines, runners or the command line.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.bench.prompts import BenchPrompt
from app.bench.records import Record
from app.bench.report import ALL, SCHEMA, machine_info
from app.bench.settings import LLAMA_PLAIN, BenchSettings
from app.core.types import common_prefix_length


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix); None if equal."""
    if len(a) == len(b) and common_prefix_length(a, b) == len(a):
        return None
    return common_prefix_length(a, b)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 and num > 0 else None


Baseline = dict[tuple[str, int], Record]  # (prompt id, repeat) -> that slot's baseline run


def summarise(records: Sequence[Record], baseline: Baseline, greedy: bool,
              hf_baseline: Baseline | None = None, own: Baseline | None = None
              ) -> dict[str, Any]:
    """Metrics of one configuration over records; speedups against baseline's same-slot runs.
    own: the plain runs of the configuration's own engine (llama.cpp's), which its outputs
    must equal; speedup_vs_own_plain is measured against them too."""
    ok = [r for r in records if r.error is None]
    pairs = _pairs(ok, baseline)
    ratios = [x for x in (_ratio(r.decode_tok_s, b.decode_tok_s) for r, b in pairs) if x]
    e2e = [x for x in (_ratio(r.e2e_tok_s, b.e2e_tok_s) for r, b in pairs) if x]
    total = _ratio(sum(r.decoded for r, _ in pairs) / max(sum(r.decode_s for r, _ in pairs), 1e-12),
                   sum(b.decoded for _, b in pairs) / max(sum(b.decode_s for _, b in pairs), 1e-12))
    out: dict[str, Any] = {
        "n_runs": len(records), "n_errors": len(records) - len(ok),
        "n_prompts": len({r.prompt_id for r in records}),
        "new_tokens": sum(len(r.token_ids) for r in ok),
        "decode_tok_s": _median([r.decode_tok_s for r in ok]),
        "e2e_tok_s": _median([r.e2e_tok_s for r in ok]),
        "speedup_median": _median(ratios), "speedup_total": total,
        "e2e_speedup_median": _median(e2e),
    }
    out.update(_engine_metrics([r.stats for r in ok if r.stats is not None]))
    same = pairs if own is None else _pairs(ok, own)
    divergences = {f"{r.prompt_id}#{r.repeat}": first_divergence(b.token_ids, r.token_ids)
                   for r, b in same}
    divergences = {key: index for key, index in divergences.items() if index is not None}
    out["identical"] = (not divergences and len(same) == len(records)) if greedy else None
    out["first_divergence"] = divergences if greedy else {}
    out["errors"] = sorted({r.error for r in records if r.error})
    out["speedup_vs_hf_plain"] = None if hf_baseline is None else _speedup(ok, hf_baseline)
    out["speedup_vs_own_plain"] = None if own is None else _speedup(ok, own)
    return out


def _speedup(records: Sequence[Record], baseline: Baseline) -> float | None:
    return _median([x for x in (_ratio(r.decode_tok_s, b.decode_tok_s)
                                for r, b in _pairs(records, baseline)) if x])


def versus(records: Sequence[Record], names: Sequence[str]) -> dict[str, Any] | None:
    """specdeck against llama.cpp in the same run: plain against plain, and each side's best
    configuration (the highest median end-to-end tok/s) against the other's. Ratios are
    medians over prompts of same-slot ratios, end to end and decode only."""
    theirs = [n for n in names if n.startswith("llama.cpp")]
    ours = [n for n in names if not n.startswith(("llama.cpp", "hf-", "remote "))]
    if LLAMA_PLAIN not in theirs or "plain" not in ours:
        return None
    slots: dict[str, Baseline] = {}
    for r in records:
        if r.error is None:
            slots.setdefault(r.config, {})[(r.prompt_id, r.repeat)] = r

    def best(group: Sequence[str]) -> str:
        return max(group, key=lambda n: _median([r.e2e_tok_s for r in slots.get(n, {}).values()])
                   or 0.0)

    def side_by_side(a: str, b: str) -> dict[str, Any]:
        pairs = [(r, slots[b][key]) for key, r in slots.get(a, {}).items() if key in
                 slots.get(b, {})]
        return {"specdeck": a, "llama.cpp": b, "n_prompts": len(pairs),
                "e2e_ratio": _median([x for x in (_ratio(r.e2e_tok_s, o.e2e_tok_s)
                                                  for r, o in pairs) if x]),
                "decode_ratio": _median([x for x in (_ratio(r.decode_tok_s, o.decode_tok_s)
                                                     for r, o in pairs) if x])}

    return {"plain": side_by_side("plain", LLAMA_PLAIN),
            "best": side_by_side(best(ours), best(theirs))}


def _pairs(records: Sequence[Record], baseline: Baseline) -> list[tuple[Record, Record]]:
    return [(r, baseline[(r.prompt_id, r.repeat)]) for r in records
            if (r.prompt_id, r.repeat) in baseline and baseline[(r.prompt_id, r.repeat)].error
            is None]


ENGINE_KEYS = ("tau", "acceptance_rate", "acceptance_per_position", "steps", "drafted",
               "accepted", "speculation_off_steps", "draft_s", "verify_s", "other_s",
               "overhead_ms_per_step", "peak_memory_bytes")


def _engine_metrics(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sums over runs, so τ and acceptance weigh every step equally (not every prompt)."""
    if not stats:
        return dict.fromkeys(ENGINE_KEYS)
    total = {key: sum(s[key] for s in stats) for key in
             ("n_new_tokens", "target_forwards", "drafted", "accepted", "draft_s", "verify_s",
              "other_s")}
    width = max(len(s["drafted_per_position"]) for s in stats)
    drafted_at = [sum(_at(s["drafted_per_position"], j) for s in stats) for j in range(width)]
    while drafted_at and drafted_at[-1] == 0:  # positions no step reached (k="auto", k_max)
        drafted_at.pop()
        width -= 1
    accepted_at = [sum(_at(s["accepted_per_position"], j) for s in stats) for j in range(width)]
    steps = total["target_forwards"]
    decoded = total["n_new_tokens"] - len(stats)  # each run's first token comes from prefill
    return {
        "tau": decoded / steps if steps else 1.0,
        "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
        "acceptance_per_position": [a / d if d else 0.0
                                    for a, d in zip(accepted_at, drafted_at, strict=True)],
        "steps": steps, "drafted": total["drafted"], "accepted": total["accepted"],
        # k="auto" turning speculation off where it does not pay (absent from older RunStats)
        "speculation_off_steps": sum(s.get("speculation_off_steps", 0) for s in stats),
        "draft_s": total["draft_s"], "verify_s": total["verify_s"], "other_s": total["other_s"],
        "overhead_ms_per_step": 1000 * total["other_s"] / steps if steps else None,
        "peak_memory_bytes": max(s["peak_memory_bytes"] for s in stats),
    }


def _at(values: Sequence[int], j: int) -> int:
    return values[j] if j < len(values) else 0


@dataclass(frozen=True)
class BenchRun:
    """What one `specdeck bench` run measured: the models, the configurations (runners, and
    those unavailable with why), every record, the prompts as encoded and those skipped."""

    target: Any
    draft: Any
    backend: Any
    runners: Sequence[Any]
    unavailable: dict[str, str]
    records: Sequence[Record]
    encoded: Sequence[tuple[BenchPrompt, list[int]]]
    skipped: Sequence[str]
    settings: BenchSettings
    chat: bool


def bench_report(run: BenchRun) -> dict[str, Any]:
    """The report (the --json document) of a run: per configuration its summaries overall
    and per category, each greedy output checked against its baseline."""
    target, draft, backend, runners = run.target, run.draft, run.backend, run.runners
    unavailable, records, encoded, skipped = run.unavailable, run.records, run.encoded, run.skipped
    settings, chat = run.settings, run.chat
    greedy = settings.temperature == 0
    by_config: dict[str, list[Record]] = {}
    for r in records:
        by_config.setdefault(r.config, []).append(r)
    categories = list(dict.fromkeys(p.category for p, _ in encoded))
    baselines = {name: {(r.prompt_id, r.repeat): r for r in by_config.get(name, [])}
                 for name in ("plain", "hf-plain", LLAMA_PLAIN)}
    configs = []
    for runner in runners:
        config = runner.config
        mine = by_config.get(config.name, [])
        rows = {ALL: mine, **{c: [r for r in mine if r.category == c] for c in categories}}
        entry: dict[str, Any] = {
            "name": config.name, "drafter": config.drafter, "k": config.k, "available": True,
            "reason": None, "k_effective": getattr(getattr(runner, "engine", None), "k", None),
        }
        entry.update(runner.describe() if hasattr(runner, "describe") else {})
        hf = baselines["hf-plain"] if config.drafter.startswith("hf-") else None
        # llama.cpp's speculation must equal llama.cpp's plain decoding; its plain row says
        # where llama.cpp's kernels first part from specdeck's plain
        own = (baselines[LLAMA_PLAIN] if config.drafter.startswith("llama.cpp")
               and config.name != LLAMA_PLAIN else None)
        if getattr(runner, "baseline", None):  # a second backend's: its own plain
            own = {(r.prompt_id, r.repeat): r for r in by_config.get(runner.baseline, [])}
        entry["overall"] = summarise(rows[ALL], baselines["plain"], greedy, hf, own)
        entry["categories"] = {c: summarise(rows[c], baselines["plain"], greedy, hf, own)
                               for c in categories}
        for metrics in (entry["overall"], *entry["categories"].values()):
            # what another engine did not report is unknown, not a measured zero
            metrics.update(dict.fromkeys(set(entry.get("unreported", ())) & set(metrics)))
        configs.append(entry)
    configs += [{"name": name, "drafter": name.split()[0], "k": None, "available": False,
                 "reason": reason, "k_effective": None, "overall": None, "categories": {}}
                for name, reason in unavailable.items()]
    return {
        "schema": SCHEMA,
        "machine": machine_info(target, backend),
        "settings": {
            "target": target.name, "draft": getattr(draft, "name", None),
            "target_weights_bytes": target.weights_bytes(),
            "draft_weights_bytes": draft.weights_bytes() if draft is not None else None,
            "drafters": list(settings.drafters), "k": list(settings.ks),
            "max_new_tokens": settings.max_new_tokens, "repeats": settings.repeats,
            "temperature": settings.temperature, "seed": settings.seed,
            "warmup": settings.warmup, "chat": chat, "compare_hf": settings.compare_hf,
            "categories": categories, "n_prompts": len(encoded), "skipped_prompts": list(skipped),
        },
        "peak_memory_bytes": target.peak_memory_bytes(),
        "configs": configs,
        "versus": versus(records, [c["name"] for c in configs if c["available"]]),
        "runs": [_run_json(r) for r in records],
    }


def _run_json(r: Record) -> dict[str, Any]:
    return {"config": r.config, "prompt_id": r.prompt_id, "category": r.category,
            "repeat": r.repeat, "n_new_tokens": len(r.token_ids), "decode_tok_s": r.decode_tok_s,
            "e2e_tok_s": r.e2e_tok_s, "total_s": r.total_s, "error": r.error,
            "token_ids": list(r.token_ids), "stats": r.stats}
