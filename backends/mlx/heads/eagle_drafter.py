"""MlxEagleDrafter: an EAGLE-3 or EAGLE-1/2 head drafts chains on MLX from the target's own
hidden states, which the engine's verify forwards capture (no extra target forward).

Knows: the Drafter protocol, the head API of backends/mlx/heads/eagle.py, the shared sampling
pipeline, mlx arrays and streams; the head's rows are kept by backends/heads/head_rows.py. Must not
know: verification, the target's cache.

The same drafter as backends/torch/heads/eagle_drafter.py, chains only (the head's own
attention takes consecutive rows: EAGLE-2 trees are refused by MlxBackend.make_drafter).
Alignment (HEADS.md 1.2, 1.3): the head row at position t reads the target's state at t and
the embedding of token t + 1; its output scores token t + 2. The head's KV cache holds only
rows built from target states, so it follows the accepted path: the verify forward's states
for the pending token and the accepted drafts arrive in `accept` and are read at the next
`propose`, whose context supplies their tokens (a chain's drafted rows never stay). Greedy
chains stay on the device until the chain is read back once; sampled chains report q over
the target vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from app.core.sampling import sample, warp
from app.core.types import Draft, SamplingParams
from backends.heads.head_rows import HeadRows
from backends.mlx.heads.eagle import Eagle1Head, Eagle3Head, target_parts
from backends.heads.eagle_format import EagleSpec


class MlxEagleDrafter(HeadRows):
    """Drafts chains with an EAGLE-3 or EAGLE-1/2 head on an MLX target."""

    def __init__(self, target: Any, head: Eagle3Head | Eagle1Head, spec: EagleSpec,
                 min_confidence: float = 0.0) -> None:
        self.head, self.spec = head, spec
        self.min_confidence = min_confidence  # a chain stops below this (HeadRows.confident)
        self.name = spec.kind
        self._hs = spec.hs_ids(target.n_layers)
        # the session's hook on layer L returns its output: hidden-state index L + 1
        self.capture_layers = tuple(sorted({i - 1 for i in self._hs}))
        embed, norm, output = target_parts(target.net, target.name)
        own = head.own_embedding()
        self._embed = own if own is not None else embed
        self._final_norm = norm if spec.kind == "eagle" else None  # EAGLE-1 reads hs[N]
        if isinstance(head, Eagle1Head):
            head.use_target_head(output)
        self._vocab = int(target.vocab_size)
        self._stream = target.stream
        # target id of each draft-vocabulary row, for sampled chains' full-width q
        self._targets = np.array(head.to_target(mx.arange(spec.draft_vocab_size)))
        self._params, self._rng = SamplingParams(), np.random.default_rng()
        self._reset()

    def propose(self, context: Sequence[int], k: int) -> Draft:
        context = [int(t) for t in context]
        if not self._can_draft(context):
            return Draft()
        with mx.stream(self._stream):
            self._read_pending(context)
            if k <= 0 or self._root is None:
                return Draft()
            return self._draft_chain(k)

    # ------------------------------------------------------------------ the head's cache

    def _join(self, parts: list[mx.array]) -> mx.array:
        return mx.concatenate(parts)

    def _read_pending(self, context: list[int]) -> None:
        """Run the head over the target states that arrived since the last propose."""
        pending = self._take_pending()
        if pending is None:
            return
        layers, following, start = pending
        end = start + len(following)
        features = [layers[i - 1] for i in self._hs]
        if self._final_norm is not None:
            features = [self._final_norm(f) for f in features]
        hidden = self.head.project(features)[None]
        tokens = mx.array([following])
        h, past = self.head(self._embed(tokens), hidden, start, self._past)
        self._commit(context, start, end, past,
                     (self.head.logits(h[0, -1]), self.head.feedback(h[0, -1])))
        mx.eval(self._root, self._past)  # rows of past steps are built once, not per chain

    # ------------------------------------------------------------------ chains

    def _draft_chain(self, k: int) -> Draft:
        logits, feedback = self._root
        position = self._next  # the pending token's position: the first draft row's
        past = self._past
        chosen: list[mx.array] = []
        probs: list[np.ndarray] = []
        reach = 1.0
        for j in range(k):
            token, q = self._choose(logits)
            chosen.append(token)
            if q is not None:
                probs.append(q)
            reach *= self._probability(logits, token, q)
            if j == k - 1 or not self.confident(reach):
                break
            h, past = self.head(self._embed(token[None]), feedback[None, None], position, past)
            position += 1
            logits, feedback = self.head.logits(h[0, -1]), self.head.feedback(h[0, -1])
            mx.async_eval(logits, feedback)
        tokens = mx.concatenate(chosen).tolist()  # a greedy chain leaves the device once
        return Draft(tokens=tuple(int(t) for t in tokens),
                     probs=np.stack(probs) if probs else None, source=self.name)

    def _probability(self, draft_logits: mx.array, token: mx.array, q: np.ndarray | None
                     ) -> float:
        """The head's probability of the token it chose; 1.0 (no read back) when no cut-off
        is set, so a greedy chain leaves the device once."""
        if not self.min_confidence:
            return 1.0
        if q is not None:
            return float(q[int(token.item())])
        return float(mx.max(mx.softmax(draft_logits.astype(mx.float32), axis=-1)).item())

    def _choose(self, draft_logits: mx.array) -> tuple[mx.array, np.ndarray | None]:
        """[1] target id: the argmax when greedy (left on the device); else a sample from q
        over the target vocabulary, q returned."""
        if self._params.greedy:
            return self.head.to_target(mx.argmax(draft_logits, keepdims=True)), None
        full = np.full(self._vocab, -np.inf, dtype=np.float32)
        full[self._targets] = np.array(draft_logits.astype(mx.float32))
        q = warp(full, self._params)
        return mx.array([sample(q, self._rng)]), q
