"""SpecEngine: the one decoding loop for plain and speculative generation.

Knows: the step (propose -> verify forward -> accept/reject -> rewind -> tell the drafter),
the pending-token invariant, stop rules, metrics and events. Must not know: array
libraries; it talks to a Model, its Session and a Drafter through app/core/protocols.py and
samples through app/core/sampling.py.

Pending-token invariant: the session's cache holds every committed token except the last,
the pending token, which leads the next verify batch [pending, d1 .. dk].
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from app.core.adaptive import KController
from app.core.protocols import Drafter, Model, TargetOutput
from app.core.sampling import sample, warp
from app.core.text import IncrementalDetokenizer
from app.core.types import (
    Done,
    Draft,
    RunStats,
    SamplingParams,
    SpecdeckError,
    Step,
    StopReason,
    common_prefix_length,
)
from app.core.verify import verify_greedy, verify_sampled
from app.drafters.ngram import NoDrafter

Event = Step | Done


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
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_start: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record(self, n_drafted: int, n_accepted: int) -> None:
        width = max(self.k, n_drafted)
        for counts in (self.drafted_at, self.accepted_at):
            counts.extend([0] * (width - len(counts)))
        self.histogram.extend([0] * (width + 1 - len(self.histogram)))
        for j in range(n_drafted):
            self.drafted_at[j] += 1
        for j in range(n_accepted):
            self.accepted_at[j] += 1
        self.histogram[n_accepted] += 1
        self.forwards += 1
        self.drafted += n_drafted
        self.accepted += n_accepted

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
            peak_memory_bytes=peak)


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
    """Runs generations on one target with one drafter; reuses the cached prompt prefix.

    One generation at a time per engine: callers serialise access (the UI's queue, the
    server's per-model lock).
    """

    def __init__(self, target: Model, drafter: Drafter | None = None, k: int | str = 4,
                 k_max: int = 8) -> None:
        if k != "auto" and (not isinstance(k, int) or k < 0):
            raise SpecdeckError(f"k must be an integer >= 0 or 'auto' (got {k!r})")
        self.target = target
        self.drafter: Drafter = drafter or NoDrafter()
        # k="auto": the controller picks k per step from measured costs and acceptance
        self.controller = KController(k_max=k_max) if k == "auto" and drafter else None
        self.k: int | str = k if drafter is not None else 0
        self.session = target.start(capture_layers=self.drafter.capture_layers)
        self._cached: list[int] = []  # token ids held in the session's cache, in order
        self.lock = threading.Lock()

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Refuse prompts the target cannot take, naming the fix."""
        ctx = self.target.context_length
        if not prompt_ids:
            raise SpecdeckError("the prompt is empty: give some text to continue")
        if len(prompt_ids) >= ctx:
            raise SpecdeckError(
                f"the prompt has {len(prompt_ids)} tokens but {self.target.name} takes at most "
                f"{ctx} (prompt and reply together): shorten the prompt or clear the history")

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """Yield a Step per engine step, then one Done. Errors become Done(stop_reason='error')."""
        self.check_prompt(prompt_ids)
        prompt = [int(t) for t in prompt_ids]
        limit = min(params.max_new_tokens, self.target.context_length - len(prompt))
        rng = np.random.default_rng(params.seed)
        rules = _StopRules(self.target, params, limit)
        output: list[int] = []
        from_draft: list[bool] = []
        reuse = min(common_prefix_length(self._cached, prompt), len(prompt) - 1)
        tally = _Tally(n_prompt=len(prompt), n_cached=reuse, k=self.k_max)
        try:
            self._rewind(reuse)
            if self.controller is not None and not self.controller.verify_s:
                self._probe_verify_costs(prompt[0])
            start = time.perf_counter()
            first_out = self._forward(prompt[reuse:], n_logits=1)
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
                self.drafter.begin(prompt, first_out, params, rng)
                spent = time.perf_counter() - t0
                tally.prefill_s += spent
                tally.decode_start += spent
            context = prompt + output
            while reason is None:
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
                new, flags, n_drafted, reason = self._step_once(context, limit, params, rng,
                                                                rules, tally)
                output.extend(new)
                from_draft.extend(flags)
                context.extend(new)
                yield self._step(tuple(new), tuple(flags), n_drafted, rules, tally, len(output),
                                 reason)
        except Exception as error:  # noqa: BLE001 - reported as an event, state restored below
            yield Done(text=rules.final_text(), token_ids=tuple(output), stop_reason="error",
                       stats=tally.freeze(len(output), self.target.peak_memory_bytes()),
                       error=f"{type(error).__name__}: {error}", from_draft=tuple(from_draft))
            return
        finally:
            # the cache keeps committed tokens minus the pending one, whatever happened
            committed = len(prompt) + len(output) - 1 if output else len(self._cached)
            self._rewind(min(committed, len(self._cached)))
        yield Done(text=rules.final_text(), token_ids=tuple(output), stop_reason=reason,
                   stats=tally.freeze(len(output), self.target.peak_memory_bytes()),
                   from_draft=tuple(from_draft))

    def _step_once(self, context: list[int], limit: int, params: SamplingParams,
                   rng: np.random.Generator, rules: _StopRules, tally: _Tally
                   ) -> tuple[list[int], list[bool], int, StopReason | None]:
        """One propose -> verify -> rewind -> accept step; returns the committed tokens."""
        n_output = len(context) - tally.n_prompt
        chosen = self.controller.choose() if self.controller is not None else int(self.k)
        # never draft past the token limit: the step also commits one target token
        k = min(chosen, limit - n_output - 1)
        tally.off_steps += chosen == 0 and self.controller is not None
        t0 = time.perf_counter()
        draft = self.drafter.propose(context, k) if k > 0 else Draft()
        draft = _clip(draft, k)
        t1 = time.perf_counter()
        n_cached = len(context) - 1
        out = self._forward([context[-1], *draft.tokens], n_logits=len(draft.tokens) + 1)
        verdict = (verify_greedy(draft.tokens, out.argmax) if params.greedy else
                   verify_sampled(draft, warp(out.host_logits(), params), rng))
        m = verdict.n_accepted
        self._rewind(n_cached + m + 1)  # keep pending, d1..dm
        t2 = time.perf_counter()
        self.drafter.accept(m, out)
        t3 = time.perf_counter()
        tally.draft_s += (t1 - t0) + (t3 - t2)
        tally.verify_s += t2 - t1
        tally.record(len(draft.tokens), m)
        proposed = [*draft.tokens[:m], verdict.next_token]
        new: list[int] = []
        reason: StopReason | None = None
        for token in proposed:
            new.append(token)
            reason = rules.admit(token, n_output + len(new))
            if reason is not None:
                break
        flags = [i < m for i in range(len(new))]
        if self.controller is not None:
            # the stop rules and text after t3 are this step's overhead
            drafting = (t1 - t0) + (t3 - t2) - draft.catch_up_s
            self.controller.observe(len(draft.tokens), m, drafting, t2 - t1,
                                    time.perf_counter() - t3 + draft.catch_up_s)
        return new, flags, len(draft.tokens), reason

    @property
    def k_max(self) -> int:
        return self.controller.k_max if self.controller is not None else int(self.k)

    def _probe_verify_costs(self, token: int) -> None:
        """Time forwards over 1..k_max+1 tokens once, so the first steps choose k well."""
        base = len(self._cached)
        costs: dict[int, float] = {}
        self._forward([token], n_logits=1)  # warm-up: the first forward after a load is slow
        self._rewind(base)
        # every size, twice (the faster run counts): kernels work in row blocks, so cost can
        # jump between neighbours (int8 on CPU: 4 rows 1.44x one row, 5 rows 2.8x)
        for rows in [*range(1, self.k_max + 2)] * 2:
            t0 = time.perf_counter()
            self._forward([token] * rows, n_logits=rows)
            elapsed = time.perf_counter() - t0
            costs[rows] = min(costs.get(rows, elapsed), elapsed)
            self._rewind(base)
        self.controller.seed_costs(costs)

    def _choose(self, out: TargetOutput, params: SamplingParams, rng: np.random.Generator) -> int:
        """Plain decoding's token choice on the last row, through the shared pipeline."""
        if params.greedy:
            return out.argmax[-1]
        return sample(warp(out.host_logits()[-1], params), rng)

    def _forward(self, token_ids: Sequence[int], n_logits: int) -> TargetOutput:
        out = self.session.forward(token_ids, n_logits=n_logits)
        self._cached.extend(token_ids)
        return out

    def _rewind(self, length: int) -> None:
        self.session.rewind(length)
        del self._cached[length:]

    def _step(self, tokens: tuple[int, ...], flags: tuple[bool, ...], n_drafted: int,
              rules: _StopRules, tally: _Tally, n_output: int, reason: StopReason | None) -> Step:
        # the last step of a generation streams everything, held-back text included
        return Step(tokens=tokens, from_draft=flags, text=rules.delta(final=reason is not None),
                    n_drafted=n_drafted, n_accepted=sum(flags),
                    stats=tally.freeze(n_output, 0))


def _clip(draft: Draft, k: int) -> Draft:
    if len(draft.tokens) <= k:
        return draft
    probs = None if draft.probs is None else draft.probs[:k]
    return Draft(tokens=draft.tokens[:k], probs=probs, catch_up_s=draft.catch_up_s)
