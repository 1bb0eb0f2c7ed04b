"""Model-based drafters on MLX: DraftModelDrafter (a small model of the same family).

Knows: how to run an MLX draft model autoregressively on its own prompt cache and keep that
cache in step with the committed tokens. Must not know: verification or the target's cache.
The drafter's cache follows the context by common prefix, so one rule covers both cases of
ALGORITHMS.md 3.1: after a rejection it rewinds, after full acceptance it catches up on d_k.
Greedy drafts are chained on the device and read back once per step, not once per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from app.pairing import check_vocab_compatible
from app.sampling import sample, warp
from app.types import Draft, SamplingParams, common_prefix_length
from backends.base import TargetOutput
from backends.mlx_backend import MlxModel


class DraftModelDrafter:
    """Drafts k tokens with a small model: argmax when greedy, sampled (with q) otherwise."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, target: MlxModel, draft: MlxModel) -> None:
        check_vocab_compatible(target, draft)
        self.name = "draft"
        self.model = draft
        self._vocab = min(target.vocab_size, draft.vocab_size)  # padded rows are never drafted
        self._session = draft.start(exact=False)
        self._cached: list[int] = []
        self._params = SamplingParams()
        self._rng = np.random.default_rng()

    def begin(self, prompt_ids: Sequence[int], first_output: TargetOutput,
              params: SamplingParams, rng: np.random.Generator) -> None:
        self._params, self._rng = params, rng

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft()
        reuse = min(common_prefix_length(self._cached, context), len(context) - 1)
        self._session.rewind(reuse)
        del self._cached[reuse:]
        feed = list(context[reuse:])
        if self._params.greedy:
            tokens, probs = self._greedy(feed, k), None
        else:
            tokens, probs = self._sampled(feed, k)
        # every draft token but the last went into the cache as the next step's input
        self._cached.extend(feed + tokens[:-1])
        return Draft(tokens=tuple(tokens), probs=probs)

    def accept(self, n_accepted: int, verified: TargetOutput) -> None:
        # nothing to do now: the next propose aligns the cache with the committed context
        return None

    def _greedy(self, feed: list[int], k: int) -> list[int]:
        """k argmax tokens, each fed back as a lazy device array; one sync at the end."""
        step: mx.array | list[int] = feed
        chosen = []
        for _ in range(k):
            logits = self._session.logits(step, n_logits=1)[-1, :self._vocab]
            step = mx.argmax(logits, keepdims=True)
            mx.async_eval(step)
            chosen.append(step)
        return mx.concatenate(chosen).tolist()

    def _sampled(self, feed: list[int], k: int) -> tuple[list[int], np.ndarray]:
        """k tokens drawn on the host from q = warp(draft logits), the pipeline the target uses."""
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for _ in range(k):
            out = self._session.forward(feed, n_logits=1)
            q = warp(out.host_logits()[-1, :self._vocab], self._params)
            tokens.append(sample(q, self._rng))
            rows.append(q)
            feed = [tokens[-1]]
        return tokens, np.stack(rows)
