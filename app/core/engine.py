"""SpecEngine: the one decoding loop for plain and speculative generation.

Knows: the step (propose -> verify forward -> accept/reject -> rewind -> tell the drafter),
the pending-token invariant, stop rules, metrics and events. Must not know: array
libraries; it talks to a Model, its Session and a Drafter through app/core/protocols.py and
samples through app/core/sampling.py.

Pending-token invariant: the session's cache holds every committed token except the last,
the pending token, which leads the next verify batch [pending, d1 .. dk].

One concept over 500 lines: the step's phases share the generation's state (session, feed,
k controller, stop rules), and split into modules they would pass it all back and forth.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from app.core.adaptive import KController, Load
from app.core.auto_k import AutoK
from app.core.drafting import proposal, timed
from app.core.feed import StepFeed
from app.core.protocols import (
    Drafter,
    ForwardCall,
    Forwarded,
    Members,
    Model,
    NoDrafter,
    Recorder,
    TargetOutput,
)
from app.core.sampling import sample, warp
from app.core.text import IncrementalDetokenizer
from app.core.types import (
    Done,
    Draft,
    DrafterStats,
    RunStats,
    SamplingParams,
    SpecdeckError,
    Step,
    StopReason,
    common_prefix_length,
)
from app.core.verify import verify_greedy, verify_sampled

Event = Step | Done


# a generation as a coroutine: it yields its events and the forwards it needs, and is sent
# each forward's Forwarded (None after an event)
Steps = Generator["Event | ForwardCall", "Forwarded | None", None]
# draft tokens per step at most: acceptance of a 33rd token is negligible for any drafter we
# know, and backends size their exact verify paths for k + 1 rows (backends/torch/exactness.py)
MAX_K = 32
DEFAULT_K = 4  # draft tokens per step when a call names a drafter but no k
LOCAL_PARTITION = "local"  # whose history a reply goes to when no API key names one


@dataclass
class _Tally:
    """Mutable counters of one generation; frozen into RunStats for every event."""

    n_prompt: int
    n_cached: int
    k: int
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    off_steps: int = 0
    load_off_steps: int = 0
    streams: int = 1
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_start: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    members: dict[str, DrafterStats] = field(default_factory=dict)  # by drafter name

    def record(self, n_drafted: int, depth: int, n_accepted: int, source: str,
               draft_s: float) -> None:
        """One verify step: n_drafted nodes reaching `depth` (a chain: both its length)."""
        width = max(self.k, depth)
        for counts in (self.drafted_at, self.accepted_at):
            counts.extend([0] * (width - len(counts)))
        self.histogram.extend([0] * (width + 1 - len(self.histogram)))
        for j in range(depth):
            self.drafted_at[j] += 1
        for j in range(n_accepted):
            self.accepted_at[j] += 1
        self.histogram[n_accepted] += 1
        self.forwards += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        if n_drafted:
            member = self.members.setdefault(source, DrafterStats(source))
            self.members[source] = DrafterStats(
                source, steps=member.steps + 1, drafted=member.drafted + n_drafted,
                accepted=member.accepted + n_accepted, draft_s=member.draft_s + draft_s)

    def freeze(self, n_new: int, peak: int) -> RunStats:
        decode_s = time.perf_counter() - self.decode_start if self.decode_start else 0.0
        return RunStats(
            n_prompt_tokens=self.n_prompt, n_cached_prompt_tokens=self.n_cached,
            n_new_tokens=n_new, target_forwards=self.forwards, drafted=self.drafted,
            accepted=self.accepted, accepted_per_position=tuple(self.accepted_at),
            drafted_per_position=tuple(self.drafted_at),
            accepted_length_histogram=tuple(self.histogram), prefill_s=self.prefill_s,
            ttft_s=self.ttft_s, decode_s=decode_s, draft_s=self.draft_s,
            verify_s=self.verify_s, speculation_off_steps=self.off_steps,
            load_off_steps=self.load_off_steps, streams=self.streams,
            peak_memory_bytes=peak, drafters=tuple(self.members.values()))


class _StopRules:
    """EOS ids, the token limit and stop strings, applied one committed token at a time."""

    def __init__(self, model: Model, params: SamplingParams, limit: int) -> None:
        self.eos = model.eos_token_ids
        self.limit = limit
        self.stops = params.stop
        self.detok = IncrementalDetokenizer(model.tokenizer)
        self.emitted = 0  # characters of detok.text already streamed
        self.cut: int | None = None  # text length when a stop string matched

    def admit(self, token: int, n_output: int) -> StopReason | None:
        """Commit one token (n_output counts it); return why generation ends, if it does."""
        if token in self.eos:
            return "eos"
        self.detok.push([token])
        if self.stops and self._match_stop():
            return "stop_string"
        return "length" if n_output >= self.limit else None

    def _match_stop(self) -> bool:
        text = self.detok.text
        window = text[max(self.emitted - max(map(len, self.stops)), 0):]
        hits = [window.find(s) for s in self.stops]
        hits = [h for h in hits if h >= 0]
        if hits:
            self.cut = len(text) - len(window) + min(hits)
        return bool(hits)

    def delta(self, final: bool) -> str:
        """Text to stream now, holding back a tail that may still grow into a stop string."""
        text = self.final_text() if final else self.detok.text
        end = len(text) if final else len(text) - self._held(text)
        out = text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def _held(self, text: str) -> int:
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def final_text(self) -> str:
        """The whole reply: held-back bytes flushed, cut before a matched stop string."""
        if self.cut is None:
            self.detok.flush()
            return self.detok.text
        return self.detok.text[:self.cut]


class SpecEngine:
    """The decoding loop over one loaded target: one session, so one KV cache, whatever
    drafter a call uses; the cached prompt prefix is reused across calls and drafters.

    `drafter` and `k` given here are defaults; each `generate` call may pass its own. One
    generation at a time: a second concurrent `generate` is refused. Callers that want to
    queue hold `lock` around the whole generation (the UI's busy lock, the server's).
    `recorder` hears every finished reply, plain or speculative, whatever surface asked for
    it (the history; None records nothing).
    """

    def __init__(self, target: Model, drafter: Drafter | None = None, k: int | str = 4,
                 k_max: int = 8, recorder: Recorder | None = None) -> None:
        self.target = target
        self.recorder = recorder
        self.set_default(drafter, k)
        self.k_max_default = k_max
        self.session = target.start()
        self._controllers: dict[str, KController] = {}  # k="auto" state, per drafter name
        self._verify_costs: dict[int, float] = {}  # rows -> seconds, probed once
        self._running = threading.Lock()
        self.lock = threading.Lock()
        # what the other live streams put in the next forward, set by a scheduler of batched
        # streams (app/runtime/streams.py) before each step; k="auto" prices drafts by it
        self.load = Load()

    def set_default(self, drafter: Drafter | None, k: int | str = 4) -> None:
        """The drafter and k a `generate` call that names none uses (a surface's configured
        ones; no drafter is plain decoding)."""
        check_k(k)
        self.drafter: Drafter = drafter or NoDrafter()
        self.k: int | str = k if drafter is not None else 0

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Refuse prompts the target cannot take, naming the fix."""
        ctx = self.target.context_length
        if not prompt_ids:
            raise SpecdeckError("the prompt is empty: give some text to continue")
        if len(prompt_ids) >= ctx:
            raise SpecdeckError(
                f"the prompt has {len(prompt_ids)} tokens but {self.target.name} takes at most "
                f"{ctx} (prompt and reply together): shorten the prompt or clear the history")

    def controllers(self, drafter: Drafter | None = None, k: int | str | None = None
                    ) -> list[KController] | None:
        """The k controllers a call with this drafter and k uses, one per member of a chain
        (app/core/auto_k.py), kept across calls; None unless k is "auto"."""
        drafter = drafter or self.drafter
        k = self.k if k is None else k
        if k != "auto" or isinstance(drafter, NoDrafter):
            return None
        members = drafter.members if isinstance(drafter, Members) else None
        names = [f"{drafter.name}/{m.name}" for m in members] if members else [drafter.name]
        return [self._controllers.setdefault(name, KController(k_max=self.k_max_default))
                for name in names]

    def controller(self, drafter: Drafter | None = None, k: int | str | None = None
                   ) -> KController | None:
        """The controller of the drafter (a chain's: its last member's, the model's)."""
        controllers = self.controllers(drafter, k)
        return controllers[-1] if controllers else None

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancel: threading.Event | None = None, *, drafter: Drafter | None = None,
                 k: int | str | None = None, partition: str = LOCAL_PARTITION
                 ) -> Iterator[Event]:
        """Decode a reply to prompt_ids, speculatively when a drafter is given.

        Args: drafter and k default to the engine's own; k is a count or "auto" (chosen per
        step by a controller kept per drafter name). cancel, when set, ends the generation
        after the current step with stop_reason "cancelled". partition: whose history the
        reply is recorded in (the engine's recorder).
        Yields: a Step per engine step (the first is the prefill's token), then one Done;
        errors become Done(stop_reason="error"). On exit, however it ends, the session
        holds the prompt and every committed token but the last (the pending token).
        """
        yield from run_alone(self.steps(prompt_ids, params, cancel, drafter=drafter, k=k,
                                        partition=partition))

    def steps(self, prompt_ids: Sequence[int], params: SamplingParams,
              cancel: threading.Event | None = None, *, drafter: Drafter | None = None,
              k: int | str | None = None, partition: str = LOCAL_PARTITION) -> Steps:
        """generate's generation as a coroutine: it yields each target forward it needs as a
        ForwardCall on this engine's session, to be sent back its Forwarded, and its events
        between them. A scheduler of batched streams runs many at once (their forwards as
        one); run_alone runs one."""
        self.check_prompt(prompt_ids)
        if drafter is None:
            drafter, k = self.drafter, (self.k if k is None else k)
        k = DEFAULT_K if k is None else k
        check_k(k)
        if not self._running.acquire(blocking=False):
            raise SpecdeckError("this model is already generating: wait for it or stop it")
        try:
            yield from self._generate(prompt_ids, params, cancel, drafter, k, partition)
        finally:
            self._running.release()

    def _generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                  cancel: threading.Event | None, drafter: Drafter, k: int | str,
                  partition: str) -> Steps:
        controllers = self.controllers(drafter, k)
        call = _Call(drafter=drafter, k=k,
                     auto=AutoK(drafter, controllers) if controllers else None)
        prompt = [int(t) for t in prompt_ids]
        limit = min(params.max_new_tokens, self.target.context_length - len(prompt))
        rng = np.random.default_rng(params.seed)
        rules = _StopRules(self.target, params, limit)
        output: list[int] = []
        from_draft: list[bool] = []
        reuse = min(common_prefix_length(self.session.tokens, prompt), len(prompt) - 1)
        tally = _Tally(n_prompt=len(prompt), n_cached=reuse, k=call.k_max)
        try:
            self.session.rewind(reuse)
            if call.auto is not None:
                call.auto.start(self._probe_verify_costs(prompt[0], call.k_max)
                                if call.auto.needs_costs() else None)
            start = time.perf_counter()
            forwarded = yield ForwardCall(self.session, tuple(prompt[reuse:]), 1,
                                          capture=tuple(drafter.capture_layers))
            first_out = forwarded.out
            first = self._choose(first_out, params, rng)
            tally.prefill_s = tally.ttft_s = time.perf_counter() - start
            tally.decode_start = time.perf_counter()
            output.append(first)
            from_draft.append(False)
            reason = rules.admit(first, 1)
            yield self._step((first,), (False,), 0, rules, tally, len(output), reason)
            if reason is None:
                # the drafter reads the prompt after the first token is out: prefill work
                # (a long prompt took a 0.5B drafter seconds here), timed as prefill
                t0 = time.perf_counter()
                drafter.begin(prompt, StepFeed.prompt(prompt, first_out, first, reuse),
                              params, rng)
                spent = time.perf_counter() - t0
                tally.prefill_s += spent
                tally.decode_start += spent
            context = prompt + output
            while reason is None:
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
                result = yield from self._step_once(call, context, limit, params, rng, rules,
                                                    tally)
                output.extend(result.tokens)
                from_draft.extend(result.from_draft)
                context.extend(result.tokens)
                reason = result.reason
                yield self._step(result.tokens, result.from_draft, result.n_drafted, rules,
                                 tally, len(output), reason)
        except Exception as error:  # noqa: BLE001 - reported as an event, state restored below
            yield Done(text=rules.final_text(), token_ids=tuple(output), stop_reason="error",
                       stats=tally.freeze(len(output), self.target.peak_memory_bytes()),
                       error=f"{type(error).__name__}: {error}", from_draft=tuple(from_draft))
            return
        finally:
            # the cache keeps committed tokens minus the pending one, whatever happened
            committed = len(prompt) + len(output) - 1 if output else self.session.length
            self.session.rewind(min(committed, self.session.length))
        if self.recorder is not None and output:
            self.recorder.record(partition, prompt, output)
        yield Done(text=rules.final_text(), token_ids=tuple(output), stop_reason=reason,
                   stats=tally.freeze(len(output), self.target.peak_memory_bytes()),
                   from_draft=tuple(from_draft))

    def _step_once(self, call: _Call, context: list[int], limit: int, params: SamplingParams,
                   rng: np.random.Generator, rules: _StopRules, tally: _Tally
                   ) -> Generator[ForwardCall, Forwarded, _StepResult]:
        """One propose -> verify -> keep -> accept step; returns the committed tokens."""
        n_output = len(context) - tally.n_prompt
        cap = limit - n_output - 1  # never draft past the limit: a step adds a target token
        load = self.load
        tally.streams = 1 + load.streams
        # a draft model's forwards are yielded too (batched with other streams' drafts);
        # drafting's seconds are its own, not the time it waited for theirs
        if call.auto is not None:
            draft, proposing = yield from timed(call.auto.propose_steps(context, cap, load))
            tally.off_steps += call.auto.off
            tally.load_off_steps += call.auto.off_by_load
        else:
            k = min(int(call.k), cap)
            draft, proposing = (yield from timed(proposal(call.drafter, context, k))) \
                if k > 0 else (Draft(), 0.0)
            draft = draft.within(k)
        tree = draft.is_tree
        if tree and not self.target.capabilities.tree_attention:
            draft, tree = draft.first_chain(), False  # this backend verifies chains only
        n_cached = len(context) - 1
        rows = len(draft.tokens) + 1
        forwarded = yield ForwardCall(self.session, (context[-1], *draft.tokens), rows,
                                      tuple(draft.row_parents()) if tree else None,
                                      tuple(call.drafter.capture_layers))
        back = time.perf_counter()
        out = forwarded.out
        verdict = (verify_greedy(draft, out.argmax) if params.greedy else
                   verify_sampled(draft, warp(out.host_logits(), params), rng))
        feed = StepFeed.verify(context[-1], n_cached, draft, verdict, out)
        self.session.keep(n_cached, feed.rows)  # pending + accepted
        t2 = time.perf_counter()
        call.drafter.accept(feed)
        t3 = time.perf_counter()
        drafting = proposing + (t3 - t2)
        verifying = forwarded.seconds + (t2 - back)  # the forward's own time, and keep's
        tally.draft_s += drafting
        tally.verify_s += verifying
        depth = max(draft.depths(), default=0)
        tally.record(len(draft.tokens), depth, verdict.n_accepted, draft.source, drafting)
        m = verdict.n_accepted
        new: list[int] = []
        reason: StopReason | None = None
        for token in feed.following:  # the accepted drafts, then the bonus or recovered
            new.append(token)
            reason = rules.admit(token, n_output + len(new))
            if reason is not None:
                break
        if call.auto is not None:
            # the stop rules and text after t3 are this step's overhead
            call.auto.observe(depth, m, drafting - draft.catch_up_s, verifying,
                              time.perf_counter() - t3, source=draft.source,
                              rows=rows, catch_up_s=draft.catch_up_s,
                              catch_up_rows=draft.catch_up_rows,
                              reads_prompt=draft.reads_prompt,
                              load_rows=max(forwarded.rows - rows, 0))
        return _StepResult(tokens=tuple(new), from_draft=tuple(i < m for i in range(len(new))),
                           n_drafted=len(draft.tokens), reason=reason)

    def share_costs(self, other: SpecEngine) -> None:
        """Price k with another engine's probed verify costs (a slot of the same target)."""
        self._verify_costs = other._verify_costs

    def warm_up(self) -> None:
        """Time the verify cost curve now, at load, rather than inside the first request that
        asks for k="auto": 19 forwards of 1..9 rows, each about a decode step's cost."""
        token = min(self.target.eos_token_ids, default=0)
        self._probe_verify_costs(token, self.k_max_default)

    def _probe_verify_costs(self, token: int, k_max: int) -> dict[int, float]:
        """Time forwards over 1..k_max+1 tokens once per engine, so the first steps choose k
        well; every controller of this engine starts from the same curve."""
        if len(self._verify_costs) >= k_max + 1:
            return self._verify_costs
        base = self.session.length
        costs: dict[int, float] = {}
        self.session.forward([token], n_logits=1)  # warm-up: the first forward after a load
        self.session.rewind(base)
        # every size, twice (the faster run counts): kernels work in row blocks, so cost can
        # jump between neighbours (int8 on CPU: 4 rows 1.44x one row, 5 rows 2.8x)
        for rows in [*range(1, k_max + 2)] * 2:
            t0 = time.perf_counter()
            self.session.forward([token] * rows, n_logits=rows)
            elapsed = time.perf_counter() - t0
            costs[rows] = min(costs.get(rows, elapsed), elapsed)
            self.session.rewind(base)
        self._verify_costs = costs
        return costs

    def _choose(self, out: TargetOutput, params: SamplingParams, rng: np.random.Generator) -> int:
        """Plain decoding's token choice on the last row, through the shared pipeline."""
        if params.greedy:
            return out.argmax[-1]
        return sample(warp(out.host_logits()[-1], params), rng)

    def _step(self, tokens: tuple[int, ...], flags: tuple[bool, ...], n_drafted: int,
              rules: _StopRules, tally: _Tally, n_output: int, reason: StopReason | None) -> Step:
        # the last step of a generation streams everything, held-back text included
        return Step(tokens=tokens, from_draft=flags, text=rules.delta(final=reason is not None),
                    n_drafted=n_drafted, n_accepted=sum(flags),
                    stats=tally.freeze(n_output, 0))


@dataclass(frozen=True)
class _Call:
    """One generate call's drafter, k and (for k="auto") its controllers."""

    drafter: Drafter
    k: int | str
    auto: AutoK | None

    @property
    def k_max(self) -> int:
        return self.auto.k_max if self.auto is not None else int(self.k)


@dataclass(frozen=True)
class _StepResult:
    tokens: tuple[int, ...]  # committed this step, cut at a stop rule
    from_draft: tuple[bool, ...]
    n_drafted: int
    reason: StopReason | None


def run_alone(steps: Steps) -> Iterator[Event]:
    """A generation's events, its forwards run on its own session as it asks for them; a
    forward's error is raised inside it (where it becomes its Done). Closing this closes it."""
    reply: Forwarded | None = None
    error: Exception | None = None
    try:
        while True:
            try:
                item = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration:
                return
            reply, error = None, None
            if isinstance(item, ForwardCall):
                reply, error = forward_alone(item)
            else:
                yield item
    finally:
        steps.close()


def forward_alone(call: ForwardCall) -> tuple[Forwarded | None, Exception | None]:
    """One forward on its own session, timed; its error returned to be raised in its
    generation."""
    t0 = time.perf_counter()
    try:
        out = call.run()
    except Exception as error:  # noqa: BLE001 - handed back to the generation that asked
        return None, error
    return Forwarded(out, time.perf_counter() - t0, len(call.token_ids)), None


def check_k(k: object) -> None:
    if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K):
        raise SpecdeckError(f"k must be an integer from 0 to {MAX_K}, or 'auto' (got {k!r})")


def last_done(events: Iterator[Event]) -> Done:
    """Drain a generation's events; return its Done."""
    done = None
    for event in events:
        if isinstance(event, Done):
            done = event
    if done is None:
        raise RuntimeError("the generation ended without a Done event")
    return done
