"""`specdeck bench --streams 1,2,4,8`: the verdict table. What speculation buys as users share
one target: each configuration serves N streams at once, N at each count asked.

Knows: the streams scheduler (app/runtime/streams.py: every live stream of the target in one
forward), engine events (Step, Done), what one stream keeps as the planner and serve count it
(app/catalogue/sizing.py's loaded_stream_bytes: the target's full layers per token, a window's
rows and a hybrid's state over its config; the draft model's own KV per token), llama-server
started with `--parallel N` (app/bench/llamacpp.py) and read through the remote engine. Must
not know: array libraries, HTTP wire formats.

A round starts N streams together (a barrier), each on its own prompt, and ends when the last
one is done. Aggregate tok/s is every stream's tokens over the round's wall time, prefill
included: what N clients get. Per stream: time to first token, and time per output token
(the rest of its time over its other tokens, as vLLM's benchmark defines TPOT). Rounds run
interleaved (every configuration at one stream count, then the next count; the order turns
each repeat) so drift between them cancels. Under greedy decoding every stream's tokens are
checked against its prompt decoded alone by the same engine's plain configuration.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from app import drafters
from app.bench.report import machine_info
from app.catalogue.sizing import loaded_stream_bytes
from app.core.types import Done, RunStats, SamplingParams, SpecdeckError, Step
from app.runtime.streams import Request, Streams, fork_engines

STREAM_CONTEXT = 4096  # the stream a pair is sized for (as `specdeck models` and serve size it)
RSS_EVERY_S = 0.05
Open = Callable[[list[int], SamplingParams], Iterator[Any]]  # one stream's events


@dataclass(frozen=True)
class StreamResult:
    """One stream of a round: its prompt, tokens and times (seconds from the round's start)."""

    prompt: int
    token_ids: tuple[int, ...]
    ttft_s: float | None
    total_s: float
    error: str | None

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_ids)
        if n < 2 or self.ttft_s is None:
            return None
        return (self.total_s - self.ttft_s) / (n - 1)


@dataclass(frozen=True)
class Round:
    config: str
    streams: int
    repeat: int
    wall_s: float
    results: tuple[StreamResult, ...]
    peak_rss_bytes: int | None

    @property
    def aggregate_tok_s(self) -> float:
        return sum(len(r.token_ids) for r in self.results) / self.wall_s if self.wall_s else 0.0


@dataclass(frozen=True)
class Memory:
    """What memory allows one configuration: the longest stream, and streams of `context`."""

    servable_context: int | None
    max_streams: int | None
    context: int


class Source:
    """One configuration that can serve n streams at once."""

    name: str
    family: str  # whose plain configuration its greedy outputs must equal
    memory: Memory | None = None

    def openers(self, n: int) -> list[Open]:
        raise NotImplementedError

    def pid(self, n: int) -> int | None:
        """The process serving n streams, for its RSS (None: not known here)."""
        return os.getpid()

    def reset(self) -> None:
        """Forget cached prompts, so no round starts from another's prefix."""


class LocalSource(Source):
    """A drafter kind and k on specdeck's scheduler, shared by every local configuration."""

    def __init__(self, name: str, scheduler: Streams, kind: str, k: int | str,
                 memory: Memory | None) -> None:
        self.name, self.family, self.memory = name, "specdeck", memory
        self.scheduler, self.kind, self.k = scheduler, kind, k

    def openers(self, n: int) -> list[Open]:
        if n > self.scheduler.slots:
            raise SpecdeckError(f"{n} streams asked of {self.scheduler.slots} slots")
        return [self._open] * n

    def _open(self, ids: list[int], params: SamplingParams) -> Iterator[Any]:
        request = Request(list(ids), params, self.kind, self.k if self.kind != "none" else 0,
                          "bench", threading.Event())
        return self.scheduler.submit(request).events()

    def reset(self) -> None:
        for engine in self.scheduler.engines:
            engine.session.rewind(0)


class RemoteSource(Source):
    """An OpenAI-compatible server per stream count (llama-server started with --parallel n,
    or one server for every count), a client per stream."""

    def __init__(self, name: str, clients: dict[int, list[Any]],
                 servers: dict[int, Any] | None = None, family: str = "llama.cpp") -> None:
        self.name, self.family, self.memory = name, family, None
        self.servers, self.clients = servers or {}, clients

    def openers(self, n: int) -> list[Open]:
        return [client.generate for client in self.clients[n][:n]]

    def pid(self, n: int) -> int | None:
        server = self.servers.get(n)
        return server.process.pid if server is not None else None  # a server not ours


def local_sources(pair: Any, settings: Any, slots: int, log: Callable[[str], None]
                  ) -> tuple[list[Source], dict[str, str]]:
    """Plain and each (drafter, k) of settings on one scheduler of `slots` slots over the
    pair's engine (each slot builds its own drafter through the pair)."""
    target, draft, backend = pair.target, pair.draft, pair.backend

    def build(kind: str) -> Any:
        return pair.build(kind, vocab_limit=settings.draft_vocab)

    engine = pair.fresh_engine()
    engine.warm_up()  # as serve does: every slot prices k from one probed cost curve
    scheduler = Streams(fork_engines(engine, slots), build)
    room, path = _room(backend, target), getattr(getattr(pair, "spec", None), "target", None)
    # one count with the draft model, one without: each reads the target's config again
    memories = {uses: memory_of(target, draft if uses else None, room, path=path,
                                backend=backend.name) for uses in {False, draft is not None}}
    sources: list[Source] = [LocalSource("plain", scheduler, "none", 0, memories[False])]
    unavailable: dict[str, str] = {}
    for kind in dict.fromkeys(settings.drafters):
        if kind == "none":
            continue
        resolved = (settings.auto_kind or ("chain" if draft is not None else "ngram")
                    if kind == "auto" else kind)
        try:
            build(resolved)  # a kind that cannot run here says why before any round
        except (SpecdeckError, TypeError, ValueError) as error:
            for k in settings.ks:
                unavailable[f"{kind} k={k}"] = f"{type(error).__name__}: {error}"
            continue
        uses_draft = resolved.removesuffix(drafters.TREE_SUFFIX) in drafters.NEEDS_DRAFT_MODEL
        for k in settings.ks:
            name = f"{kind}{':' + resolved if kind == 'auto' else ''} k={k}"
            sources.append(LocalSource(name, scheduler, resolved, k,
                                       memories[uses_draft and draft is not None]))
    for name, why in unavailable.items():
        log(f"unavailable: {name}: {why}")
    return sources, unavailable


def _room(backend: Any, target: Any) -> int | None:
    from app.catalogue import hardware

    try:
        return hardware.available_memory(backend.name, target.device)
    except Exception:  # noqa: BLE001 - a device the probe does not know: no memory columns
        return None


def memory_of(target: Any, draft: Any, room: int | None, context: int = STREAM_CONTEXT, *,
              path: str | None = None, backend: str = "") -> Memory | None:
    """The longest stream and the streams of `context` tokens that fit in room (the memory
    left after loading): a stream of the target as sizing.loaded_stream_bytes counts it over
    its config at path on backend (a window's fixed rows, a hybrid's recurrent state), and
    the draft model's own KV per token; where no config reads, every layer's KV per token
    times the tokens. None where room or a stream's cost is unknown."""
    def stream(tokens: int) -> int:
        own = loaded_stream_bytes(draft, None, backend, tokens) if draft is not None else 0
        return loaded_stream_bytes(target, path, backend, tokens) + own

    context = min(context, target.context_length)
    at_context = stream(context)
    if room is None or at_context <= 0:
        return None
    return Memory(servable_context=_longest(room, stream, target.context_length),
                  max_streams=room // at_context, context=context)


def _longest(room: int, stream: Callable[[int], int], cap: int) -> int:
    """The most tokens up to cap one stream holds in room. A stream's bytes grow with its
    tokens, more slowly once a window is full: a search, not a division; one count where
    the longest fits (each count reads the config)."""
    if stream(cap) <= room:
        return cap
    low, high = 0, cap  # stream(low) fits, stream(high) does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if stream(mid) <= room else (low, mid)
    return low


def run_round(source: Source, n: int, prompts: Sequence[tuple[int, list[int]]],
              params: SamplingParams, repeat: int) -> Round:
    """n streams of source started together, the i-th on prompts[i]; wall time until the last
    one is done, and the peak RSS of the process serving them while they ran."""
    openers = source.openers(n)
    results: list[StreamResult | None] = [None] * n
    gate = threading.Barrier(n + 1)

    def stream(i: int) -> None:
        index, ids = prompts[i]
        gate.wait()
        start = time.perf_counter()
        first, done = None, None
        try:
            for event in openers[i](ids, params):
                if first is None and isinstance(event, Step) and event.tokens:
                    first = time.perf_counter() - start
                if isinstance(event, Done):
                    done = event
        except Exception as error:  # noqa: BLE001 - a stream that fails is counted, not fatal
            done = Done(text="", token_ids=(), stop_reason="error", stats=RunStats(),
                        error=f"{type(error).__name__}: {error}")
        total = time.perf_counter() - start
        results[i] = StreamResult(index, tuple(done.token_ids) if done else (), first, total,
                                  done.error if done else "no Done event")

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    sampler = _RssSampler(source.pid(n))
    gate.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return Round(source.name, n, repeat, wall, tuple(r for r in results if r is not None),
                 sampler.stop())


class _RssSampler:
    """The largest resident set of one process while it runs (Linux's /proc; else None)."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self.peak = pid, _rss(pid) if pid is not None else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.peak is not None:
            self._thread.start()

    def _run(self) -> None:
        while self.pid is not None and not self._stop.wait(RSS_EVERY_S):
            rss = _rss(self.pid)
            if rss is not None and self.peak is not None:
                self.peak = max(self.peak, rss)

    def stop(self) -> int | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def assignment(prompts: Sequence[list[int]], n: int, repeat: int, counts: Sequence[int]
               ) -> list[tuple[int, list[int]]]:
    """The prompts of a round of n streams: each round of a repeat its own run of prompts,
    so no engine meets a prompt twice before the solo runs (no cached prefix: llama-server
    runs without its prompt cache, a server's slots keep theirs); they wrap where the set
    holds fewer than repeats x sum(counts)."""
    start = repeat * sum(counts) + sum(c for c in counts if c < n)
    return [((start + i) % len(prompts), prompts[(start + i) % len(prompts)])
            for i in range(n)]


def prompts_needed(counts: Sequence[int], repeats: int) -> int:
    return repeats * sum(counts)


def run_verdict(sources: Sequence[Source], prompts: Sequence[list[int]],
                counts: Sequence[int], params: SamplingParams, repeats: int,
                log: Callable[[str], None], warm_up: list[int] | None = None,
                warm_up_tokens: int = 16) -> dict[str, Any]:
    """Every source at every stream count, interleaved; then each family's plain solo run of
    every prompt used (the greedy outputs the rounds must equal). warm_up: a prompt each
    source generates from first, untimed (first forwards allocate; k=auto probes its costs)."""
    if repeats < 1:
        raise SpecdeckError(f"--repeats must be >= 1 (got {repeats})")
    if warm_up:
        short = replace(params, max_new_tokens=min(params.max_new_tokens, warm_up_tokens))
        for source in sources:
            for n in counts:  # a server per count (llama-server --parallel n): each warmed
                run_round(source, n, [(-1, warm_up)] * n, short, -1)
        log(f"warm-up: {len(sources)} configurations")
    rounds: list[Round] = []
    for repeat in range(repeats):
        for n in counts:
            order = sources if (repeat + n) % 2 == 0 else sources[::-1]
            for source in order:
                source.reset()
                rounds.append(run_round(source, n, assignment(prompts, n, repeat, counts),
                                        params, repeat))
            log(f"[repeat {repeat + 1}/{repeats}] {n} stream(s): " + ", ".join(
                f"{r.config} {r.aggregate_tok_s:.1f}" for r in rounds[-len(sources):])
                + " tok/s")
    used = sorted({s.prompt for r in rounds for s in r.results})
    solos = _solos(sources, prompts, used, params, log)
    return {"rows": table(sources, rounds, solos, params.greedy),
            "rounds": [_round_json(r) for r in rounds]}


def _solos(sources: Sequence[Source], prompts: Sequence[list[int]], used: Sequence[int],
           params: SamplingParams, log: Callable[[str], None]
           ) -> dict[str, dict[int, tuple[int, ...]]]:
    """Each family's plain tokens for every prompt used, each decoded alone."""
    solos: dict[str, dict[int, tuple[int, ...]]] = {}
    for source in sources:
        if source.family in solos:
            continue
        source.reset()
        solos[source.family] = {
            i: run_round(source, 1, [(i, prompts[i])], params, -1).results[0].token_ids
            for i in used}
        log(f"solo runs: {source.name} ({source.family}), {len(used)} prompts")
    return solos


def table(sources: Sequence[Source], rounds: Sequence[Round],
          solos: dict[str, dict[int, tuple[int, ...]]], greedy: bool) -> list[dict[str, Any]]:
    """A row per configuration and stream count: medians over repeats, percentiles over
    every stream of them."""
    rows = []
    for source in sources:
        mine = [r for r in rounds if r.config == source.name]
        solo = _median([r.aggregate_tok_s for r in mine if r.streams == 1])
        for n in sorted({r.streams for r in mine}):
            at = [r for r in mine if r.streams == n]
            streams = [s for r in at for s in r.results]
            aggregate = _median([r.aggregate_tok_s for r in at])
            baseline = solos.get(source.family)
            same = (sum(s.token_ids == baseline.get(s.prompt) for s in streams)
                    if greedy and baseline else None)
            rows.append({
                "config": source.name, "engine": source.family, "streams": n,
                "solo_tok_s": solo, "aggregate_tok_s": aggregate,
                "x_solo": aggregate / solo if solo and aggregate else None,
                "tpot_ms_p50": _pct([s.tpot_s for s in streams], 50),
                "tpot_ms_p95": _pct([s.tpot_s for s in streams], 95),
                "ttft_ms_p50": _pct([s.ttft_s for s in streams], 50),
                "ttft_ms_p95": _pct([s.ttft_s for s in streams], 95),
                "identical": None if same is None else f"{same}/{len(streams)}",
                "errors": sum(s.error is not None for s in streams),
                "servable_context": source.memory.servable_context if source.memory else None,
                "max_streams": source.memory.max_streams if source.memory else None,
                "context": source.memory.context if source.memory else None,
                "peak_rss_bytes": max((r.peak_rss_bytes or 0 for r in at), default=0) or None,
            })
    return rows


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _pct(values: Sequence[float | None], q: int) -> float | None:
    """The q-th percentile in milliseconds (nearest rank), of the values measured."""
    measured = sorted(v for v in values if v is not None)
    if not measured:
        return None
    rank = max(1, -(-q * len(measured) // 100))
    return 1000 * measured[rank - 1]


def _round_json(r: Round) -> dict[str, Any]:
    return {"config": r.config, "streams": r.streams, "repeat": r.repeat, "wall_s": r.wall_s,
            "aggregate_tok_s": r.aggregate_tok_s, "peak_rss_bytes": r.peak_rss_bytes,
            "streams_detail": [{"prompt": s.prompt, "tokens": len(s.token_ids),
                                "ttft_s": s.ttft_s, "total_s": s.total_s, "error": s.error}
                               for s in r.results]}


def format_verdict(report: dict[str, Any]) -> str:
    """The verdict table: a line per configuration and stream count."""
    head = (f"{'configuration':<24} {'N':>2} {'tok/s':>7} {'x solo':>6} {'TPOT p50/p95 ms':>16} "
            f"{'TTFT p50 ms':>11} {'same':>6} {'context':>8} {'max N':>6} {'peak RSS':>9}")
    lines = [head, "-" * len(head)]
    for row in report["rows"]:
        lines.append(
            f"{row['config']:<24} {row['streams']:>2} {_f(row['aggregate_tok_s'], 1):>7} "
            f"{_f(row['x_solo'], 2):>6} "
            f"{_f(row['tpot_ms_p50'], 1) + '/' + _f(row['tpot_ms_p95'], 1):>16} "
            f"{_f(row['ttft_ms_p50'], 0):>11} {row['identical'] or '-':>6} "
            f"{row['servable_context'] or '-':>8} {row['max_streams'] or '-':>6} "
            f"{_gib(row['peak_rss_bytes']):>9}")
    return "\n".join(lines)


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _gib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.2f} GiB"


def verdict_report(target: Any, backend: Any, settings: dict[str, Any],
                   result: dict[str, Any], unavailable: dict[str, str]) -> dict[str, Any]:
    return {"kind": "streams", "settings": settings, "machine": machine_info(target, backend),
            "unavailable": unavailable, **result}


def write_verdict_plot(report: dict[str, Any], path: str) -> None:
    """Aggregate tok/s against the number of streams, a line per configuration."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SpecdeckError("--plot needs matplotlib: pip install 'specdeck[bench]'") from error
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(row["config"] for row in report["rows"]):
        rows = [r for r in report["rows"] if r["config"] == name]
        ax.plot([r["streams"] for r in rows], [r["aggregate_tok_s"] or 0 for r in rows],
                marker="o", label=name)
    ax.set_xlabel("streams at once")
    ax.set_ylabel("aggregate tok/s (median)")
    s, m = report["settings"], report["machine"]
    ax.set_title(f"{s.get('target')} | {m['cpu']} | {m['device']} {m['dtype']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as error:
        raise SpecdeckError(f"could not write the plot to {path}: {error}") from error
    finally:
        plt.close(fig)
