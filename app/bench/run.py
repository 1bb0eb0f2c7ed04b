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

import time
from collections.abc import Callable, Sequence
from typing import Any

from app import drafters
from app.bench.prompts import BenchPrompt
from app.bench.records import Config, Record
from app.bench.settings import WARMUP_TOKENS, BenchSettings
from app.bench.stats import BenchRun, bench_report
from app.bench.verify_cost import verify_costs
from app.core.engine import SpecEngine, check_k, last_done
from app.core.prompt import encode_prompt
from app.core.types import SamplingParams, SpecdeckError

TREE_SUFFIX = drafters.TREE_SUFFIX


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


def build_runners(pair: Any, settings: BenchSettings, prefix: str = ""
                  ) -> tuple[list[Any], dict[str, str]]:
    """Runners for plain plus each (drafter, k) on the pair's one engine, and the
    configurations that are unavailable (the pair's check says why). prefix: names this
    engine's configurations apart ("llamacpp:") when a second backend runs beside the first;
    they are then checked against their own plain."""
    target, draft = pair.target, pair.draft
    engine = pair.fresh_engine()  # one engine, one cache: configurations differ per call
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
            drafter = pair.build(resolved, tree=tree, vocab_limit=settings.draft_vocab)
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


def run_bench(pair: Any, prompts: Sequence[BenchPrompt], settings: BenchSettings,
              log: Callable[[str], None] | None = None,
              extra: Sequence[Any] = (), extra_unavailable: dict[str, str] | None = None
              ) -> dict[str, Any]:
    """Run every configuration on every prompt, interleaved; return the report (the JSON).
    extra: more runners (a remote engine's, llama.cpp's), interleaved with the local ones;
    extra_unavailable: their configurations that could not run, and why."""
    target, draft, backend = pair.target, pair.draft, pair.backend
    log = log or (lambda _msg: None)
    if settings.repeats < 1:
        raise SpecdeckError(f"--repeats must be >= 1 (got {settings.repeats})")
    if settings.compare_hf and settings.temperature > 0:
        raise SpecdeckError("--compare-hf compares greedy decoding: drop --temperature or "
                            "--compare-hf")
    chat = _chat_default(target, settings.chat)
    encoded, skipped = _encode(target, prompts, chat, settings.max_new_tokens)
    runners, unavailable = build_runners(pair, settings)
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
    report = bench_report(BenchRun(target, draft, backend, runners, unavailable, records,
                                   encoded, skipped, settings, chat))
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
