"""DraftModelDrafter: a small model of the target's family drafts k tokens, on any backend.

Knows: the Session protocol (forward, rewind, tokens; where a session has them, its own
output-layer views restrict_vocab and lighten_head), the shared sampling pipeline, the
vocabulary check. Must not know: array libraries (a backend may subclass it to keep its greedy
chain on the device, as MLX does), the target's cache, prompt lookup (a ChainDrafter puts
lookup in front of it). The drafter's cache follows the context by common prefix, so one rule
covers both cases of ALGORITHMS.md 3.1: after a rejection it rewinds, after full acceptance
it catches up on d_k.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from app.core.drafting import Proposal, alone
from app.core.protocols import BatchForward, ForwardCall, Model, StepFeed, TargetOutput, VocabViews
from app.core.sampling import sample, warp
from app.core.types import Draft, SamplingParams, SpecdeckError, common_prefix_length
from app.drafters.pairing import check_vocab_compatible

CATCH_UP_ROWS = 2  # a feed longer than this is missed context, read before drafting
# the drafter reads at most about this many of a prompt's last tokens: its prefill is paid
# before the first draft (spec-bench rag, 600-800-token prompts, 2-core EPYC: chain 0.81x
# plain end to end while 1.08x in decode; the 0.5B Qwen reads 800 tokens in 0.92 s, 512 in
# 0.55 s). The window grows with the answer, and a following turn keeps it while it is under
# twice this, so a chat's cache is reused
DRAFT_CONTEXT = 512
# vocab_limit N > 0: the drafter computes logits only for ids below N (byte-level BPE numbers
# its tokens in merge order, so low ids are the frequent ones), the prompt's tokens and EOS:
# FR-Spec's idea with merge order for corpus counts. Off by default: on the Qwen pair (int8)
# 32768 cut a draft token from 46.9 to 36.9 ms but acceptance fell from 58-71% to 57-65%


class DraftModelDrafter:
    """Drafts k tokens with a small model: argmax when greedy, sampled (with q) otherwise."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, target: Model, draft: Model, min_confidence: float = 0.0,
                 vocab_limit: int = 0) -> None:
        check_vocab_compatible(target, draft)
        if vocab_limit < 0:
            raise SpecdeckError(f"--draft-vocab must be 0 (whole vocabulary) or a positive "
                                f"number of token ids (got {vocab_limit})")
        self.name = "draft"
        self.model = draft
        # stop drafting once the draft's top probability falls below this (llama.cpp's p-min):
        # an unsure draft token is likely rejected and would waste the rest of the chain
        self.min_confidence = min_confidence
        self._vocab = min(target.vocab_size, draft.vocab_size)  # padded rows are never drafted
        self._always = {*target.eos_token_ids, *draft.eos_token_ids}
        self._session = draft.start(exact=False)
        # the output-layer views below are the session's own: the model object stays as it
        # is for the target and other drafters that share it
        views = isinstance(self._session, VocabViews)
        if draft is not target and views:
            self._session.lighten_head()  # a model of its own: its logits only propose
        # 0 = full vocabulary; sessions without restrict_vocab (MLX) draft from all of it
        self.vocab_limit = vocab_limit if views else 0
        self._start = 0  # where the drafter's window begins in the context
        self._prompt_unread = False  # begin() sets it: the next catch-up reads the prompt
        self._params = SamplingParams()
        self._rng = np.random.default_rng()

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed | None, params: SamplingParams,
              rng: np.random.Generator) -> None:
        self._params, self._rng = params, rng
        if 0 < self.vocab_limit < self._vocab // 2:
            keep = {*range(self.vocab_limit), *self._always, *prompt_ids}
            self._session.restrict_vocab(sorted(i for i in keep if i < self._vocab))
        self._start = self._window_start(prompt_ids)
        # the prompt is read when this drafter first drafts (as catch-up), not now: a reply
        # whose k controller keeps the model off never pays for it (a chat prompt cost the
        # 0.5B Qwen 0.2 s of every request, read and never drafted from)
        self._prompt_unread = True

    def _window_start(self, prompt_ids: Sequence[int]) -> int:
        """Where the window begins for this prompt: at its last DRAFT_CONTEXT tokens, unless
        the cache holds the start of this prompt's window already (a chat's next turn) and
        reading the rest costs no more than a fresh window, within twice the window. An
        unrelated prompt of 512-1,024 tokens kept an older prompt's start and was read whole
        (spec-bench rag: 2.6 s of the 0.5B Qwen before its first draft)."""
        fresh = max(0, len(prompt_ids) - DRAFT_CONTEXT)
        window = len(prompt_ids) - self._start
        if not 0 < window <= 2 * DRAFT_CONTEXT:
            return fresh
        shared = common_prefix_length(self._session.tokens, prompt_ids[self._start:])
        return self._start if shared and window - shared <= DRAFT_CONTEXT else fresh

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return alone(self._propose(context, k, stepwise=False))

    def propose_steps(self, context: Sequence[int], k: int) -> Proposal:
        """propose, its forwards yielded to a scheduler that batches them with other
        streams' drafts, where the draft model runs batched forwards."""
        return (yield from self._propose(context, k, isinstance(self.model, BatchForward)))

    def _propose(self, context: Sequence[int], k: int, stepwise: bool) -> Proposal:
        if k <= 0:
            return Draft()
        feed = self._align(context[self._start:])
        caught_up, read = 0.0, 0
        # after steps without drafting, read the missed tokens apart from drafting, so their
        # cost is reported as catch-up (a step normally feeds 1-2 tokens: d_k and the bonus)
        if len(feed) > CATCH_UP_ROWS:
            _, caught_up = yield from self._forward(feed[:-1])
            read, feed = len(feed) - 1, feed[-1:]
        reads_prompt, self._prompt_unread = self._prompt_unread and caught_up > 0, False
        tokens, probs = (yield from self._draft_steps(feed, k)) if stepwise else \
            self._draft(feed, k)
        return Draft(tokens=tuple(tokens), probs=probs, source=self.name, catch_up_s=caught_up,
                     catch_up_rows=read, reads_prompt=reads_prompt)

    def _forward(self, feed: list[int]) -> Proposal:
        """One forward of the drafter's session, and its seconds. A sampled stream's run
        here, alone: this session is not exact, so other streams' rows in one forward could
        move the last bits of q, and with them the seeded draws (a greedy draft only
        proposes: the target's verify decides every token)."""
        call = ForwardCall(self._session, tuple(feed), 1, model=self.model)
        if self._params.greedy:
            forwarded = yield call
            return forwarded.out, forwarded.seconds
        t0 = time.perf_counter()
        return call.run(), time.perf_counter() - t0

    def unread_rows(self, context: Sequence[int]) -> int:
        """The context rows the next draft reads before drafting (this reply's prompt, or
        what steps without drafting committed; 0 when only the usual 1-2 are new): the k
        controller weighs them against what drafting can save in the reply's budget."""
        window = context[self._start:]
        if not window:
            return 0
        feed = len(window) - self._reuse(window)
        return feed - 1 if feed > CATCH_UP_ROWS else 0

    def accept(self, feed: StepFeed) -> None:
        # nothing to do now: the next propose aligns the cache with the committed context
        return None

    def _align(self, context: Sequence[int]) -> list[int]:
        """Rewind the cache to what it shares with the context; return the tokens to feed
        (at least the last: drafting needs its logits row)."""
        reuse = self._reuse(context)
        self._session.rewind(reuse)
        return list(context[reuse:])

    def _reuse(self, window: Sequence[int]) -> int:
        """The cached rows the window keeps: all it shares with the cache but its last token,
        whose logits row drafting needs."""
        return min(common_prefix_length(self._session.tokens, window), len(window) - 1)

    def _draft(self, feed: list[int], k: int) -> tuple[list[int], np.ndarray | None]:
        return alone(self._draft_steps(feed, k))

    def _draft_steps(self, feed: list[int], k: int) -> Proposal:
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for _ in range(k):
            out, _ = yield from self._forward(feed)
            token, q = self._choose(out)
            if tokens and self.min_confidence and self._confidence(out, q) < self.min_confidence:
                break
            tokens.append(token)
            if q is not None:
                rows.append(q)
            feed = [token]
        return tokens, (np.stack(rows) if rows else None)

    def _confidence(self, out: TargetOutput, q: np.ndarray | None) -> float:
        if q is not None:
            return float(q.max())
        logits = out.host_logits()[-1, :self._vocab].astype(np.float64)
        return float(1.0 / np.exp(logits - logits.max()).sum())

    def _choose(self, out: TargetOutput) -> tuple[int, np.ndarray | None]:
        if self._params.greedy:
            token = out.argmax[-1]
            if token < self._vocab:
                return token, None
        q = warp(out.host_logits()[-1, :self._vocab], self._params)
        return sample(q, self._rng), (None if self._params.greedy else q)
