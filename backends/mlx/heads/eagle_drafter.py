"""MlxEagleDrafter: an EAGLE-3 or EAGLE-1/2 head drafts chains on MLX from the target's own
hidden states, which the engine's verify forwards capture (no extra target forward).

Knows: the Drafter protocol, the head API of backends/mlx/heads/eagle.py, the shared sampling
pipeline, mlx arrays and streams. Must not know: verification, the target's cache.

The same drafter as backends/torch/heads/eagle_drafter.py, chains only (an MLX session
verifies chains: EAGLE-2 trees are refused by MlxBackend.head_drafter). Alignment (HEADS.md
1.2, 1.3): the head row at position t reads the target's state at t and the embedding of
token t + 1; its output scores token t + 2. The head's KV cache holds only rows built from
target states, so it follows the accepted path: the verify forward's states for the pending
token and the accepted drafts arrive in `accept` and are read at the next `propose`, whose
context supplies their tokens (a chain's drafted rows never stay). Greedy chains stay on the
device until the chain is read back once; sampled chains report q over the target vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from app.core.protocols import TargetOutput
from app.core.sampling import sample, warp
from app.core.types import Draft, SamplingParams, Verdict, common_prefix_length
from backends.mlx.heads.eagle import KV, Eagle1Head, Eagle3Head, target_parts
from backends.torch.heads.eagle_format import EagleSpec


class MlxEagleDrafter:
    """Drafts chains with an EAGLE-3 or EAGLE-1/2 head on an MLX target."""

    def __init__(self, target: Any, head: Eagle3Head | Eagle1Head, spec: EagleSpec) -> None:
        self.head, self.spec = head, spec
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

    def _reset(self) -> None:
        self._past: list[KV] | None = None  # committed head rows (from target states)
        self._rows: list[int] = []  # position of each committed row
        self._ctx: list[int] = []  # tokens of the context the rows were built from
        self._pending: list[dict[int, mx.array]] = []  # target states not yet read
        self._pending_start = 0  # position of the first pending row
        self._fed_upto = 0  # rows exist (committed or pending) for positions below this
        self._root: tuple[mx.array, mx.array] | None = None  # logits, feedback

    # ------------------------------------------------------------------ protocol

    def begin(self, prompt_ids: Sequence[int], first_output: TargetOutput,
              params: SamplingParams, rng: np.random.Generator) -> None:
        self._params, self._rng = params, rng
        prompt = [int(t) for t in prompt_ids]
        states = self._states(first_output, None)
        n_rows = next(iter(states.values())).shape[0]
        # a committed row t read tokens up to t + 1: it stays while those match the prompt
        self._truncate(common_prefix_length(self._ctx, prompt) - 2)
        start = len(prompt) - n_rows  # the prefill covered positions start .. len - 1
        first = max(start, self._rows[-1] + 1 if self._rows else 0)
        self._pending = [{i: s[first - start:] for i, s in states.items()}]
        self._pending_start, self._fed_upto = first, len(prompt)
        self._ctx, self._root = prompt, None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        context = [int(t) for t in context]
        if self._fed_upto != len(context) - 1:
            return Draft()  # states for this context never arrived (no begin): no draft
        with mx.stream(self._stream):
            self._read_pending(context)
            if k <= 0 or self._root is None:
                return Draft()
            return self._draft_chain(k)

    def accept(self, verdict: Verdict, verified: TargetOutput) -> None:
        rows = mx.array([0, *(i + 1 for i in verdict.path)])
        if not self._pending:
            self._pending_start = self._fed_upto
        self._pending.append(self._states(verified, rows))
        self._fed_upto += rows.size

    # ------------------------------------------------------------------ the head's cache

    def _states(self, out: TargetOutput, rows: mx.array | None) -> dict[int, mx.array]:
        """Captured layer -> [rows, hidden] (the chosen rows of a verify forward)."""
        return {layer: out.hidden_states[layer] if rows is None
                else mx.take(out.hidden_states[layer], rows, axis=0)
                for layer in self.capture_layers}

    def _truncate(self, last_position: int) -> None:
        keep = sum(1 for p in self._rows if p <= last_position)
        self._rows = self._rows[:keep]
        if self._past is not None:
            self._past = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self._past]

    def _read_pending(self, context: list[int]) -> None:
        """Run the head over the target states that arrived since the last propose."""
        if not self._pending:
            return
        layers = {i: mx.concatenate([p[i] for p in self._pending]) for i in self.capture_layers}
        self._pending = []
        start, end = self._pending_start, self._fed_upto
        features = [layers[i - 1] for i in self._hs]
        if self._final_norm is not None:
            features = [self._final_norm(f) for f in features]
        hidden = self.head.project(features)[None]
        tokens = mx.array([context[start + 1:end + 1]])
        h, self._past = self.head(self._embed(tokens), hidden, start, self._past)
        self._rows.extend(range(start, end))
        self._ctx = context
        self._root = (self.head.logits(h[0, -1]), self.head.feedback(h[0, -1]))
        mx.eval(self._root, self._past)  # rows of past steps are built once, not per chain

    # ------------------------------------------------------------------ chains

    def _draft_chain(self, k: int) -> Draft:
        logits, feedback = self._root
        position = self._fed_upto  # the pending token's position: the first draft row's
        past = self._past
        chosen: list[mx.array] = []
        probs: list[np.ndarray] = []
        for j in range(k):
            token, q = self._choose(logits)
            chosen.append(token)
            if q is not None:
                probs.append(q)
            if j == k - 1:
                break
            h, past = self.head(self._embed(token[None]), feedback[None, None], position, past)
            position += 1
            logits, feedback = self.head.logits(h[0, -1]), self.head.feedback(h[0, -1])
            mx.async_eval(logits, feedback)
        tokens = mx.concatenate(chosen).tolist()  # a greedy chain leaves the device once
        return Draft(tokens=tuple(int(t) for t in tokens),
                     probs=np.stack(probs) if probs else None, source=self.name)

    def _choose(self, draft_logits: mx.array) -> tuple[mx.array, np.ndarray | None]:
        """[1] target id: the argmax when greedy (left on the device); else a sample from q
        over the target vocabulary, q returned."""
        if self._params.greedy:
            return self.head.to_target(mx.argmax(draft_logits, keepdims=True)), None
        full = np.full(self._vocab, -np.inf, dtype=np.float32)
        full[self._targets] = np.array(draft_logits.astype(mx.float32))
        q = warp(full, self._params)
        return mx.array([sample(q, self._rng)]), q
