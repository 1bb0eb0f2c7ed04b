"""DSpark block drafting (DeepSeek, DeepSpec), written once for every backend over the array
adapter of backends/arrays: DFlash's block and cache (backends/heads/dflash_drafter.py), then a
low-rank Markov walk over the block's rows and the confidence head's cut.

Knows: the walk and the cut (HEADS.md §11.2-11.3; DeepSpec `modeling/dspark`,
`eval/dspark/draft_ops.py`). Must not know: an array library, the weight modules'
computations (a backend's model is DFlash's with `markov_head.markov_w1` (an embedding [V, r])
and `markov_head.markov_w2` (r -> V), `confidence_head.proj` ([H (+ r)] -> 1), either absent
where the checkpoint has none), the checkpoint format (backends/heads/dspark_format.py),
verification, the engine's loop.

The block [anchor, mask x (B-1)] always has B rows (the drafter was trained on whole blocks,
and its rows see each other), and row j predicts the token at anchor + j + 1, so a block gives
B drafts (speculators checkpoints with sample_from_anchor false: rows 1.. only, as DFlash).
Left to right from x_0 = anchor, slot j's logits are lm_head(h_j) + markov_w2(markov_w1[x_(j-1)])
and x_j their argmax (left on the device, read back once per block), or a draw from
q = warp(logits), whose rows the engine's rejection test reads. The confidence
c_j = sigmoid(proj([h_j; markov_w1[x_(j-1)]])) depends only on tokens already drafted, so
stopping at the first c_j below a threshold (DeepSpec's rule; 0, its default, never stops)
keeps verification exact. The prefix survival prod c_i goes out with the draft
(Draft.survival) for the k controller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from app.core.sampling import sample, warp
from app.core.types import Draft
from backends.arrays import Arrays
from backends.heads.dflash_drafter import BlockDrafter
from backends.heads.dspark_format import DSparkShape


class DSparkDrafter(BlockDrafter):
    """Drafts up to a block's worth of tokens per step, walking the Markov chain; threshold:
    the confidence below which a block stops (0: never)."""

    name = "dspark"

    def __init__(self, model: Any, arrays: Arrays, shape: DSparkShape, *,
                 embed: Callable[[Any], Any], lm_head: Callable[[Any], Any],
                 threshold: float = 0.0) -> None:
        super().__init__(model, arrays, layer_ids=shape.layer_ids, block_size=shape.block_size,
                         mask_token_id=shape.mask_token_id, embed=embed, lm_head=lm_head)
        self.shape, self.threshold = shape, threshold

    @property
    def max_drafts(self) -> int:
        return self.block_size if self.shape.from_anchor else self.block_size - 1

    def _rows(self, k: int) -> int:
        return self.block_size  # trained on whole blocks: fewer rows change every row's output

    def _draft(self, out: Any, anchor: int, k: int) -> Draft:
        first = 0 if self.shape.from_anchor else 1
        hidden = out[first:first + k]
        if self._params.greedy:
            return self._greedy(hidden, self.lm_head(hidden), anchor)
        return self._sampled(hidden, self.lm_head(hidden), anchor)

    def _slot(self, hidden: Any, base: Any, previous: Any) -> tuple[Any, Any]:
        """One slot's (logits [1, V], confidence logit [1] or None) after the token
        `previous` ([1] on the device)."""
        markov = getattr(self.model, "markov_head", None)
        confidence = getattr(self.model, "confidence_head", None)
        before = None if markov is None else markov.markov_w1(previous)  # [1, r]
        score = None
        if confidence is not None:
            with_markov = before is not None and self.shape.confidence_with_markov
            features = self.arrays.concat([hidden, before], axis=-1) if with_markov else hidden
            score = confidence.proj(features)[0]
        return (base if before is None else base + markov.markov_w2(before)), score

    def _greedy(self, hidden: Any, base: Any, anchor: int) -> Draft:
        """The walk on the device; tokens and confidences read back once."""
        xp = self.arrays
        previous, walked, scores = xp.asarray([anchor]), [], []
        for slot in range(hidden.shape[0]):
            logits, score = self._slot(hidden[slot:slot + 1], base[slot:slot + 1], previous)
            previous = xp.argmax(logits)[:, 0]
            walked.append(previous)
            if score is not None:
                scores.append(score)
        tokens = [int(t) for t in xp.to_numpy(xp.concat(walked)).tolist()]
        confidences = _sigmoid(xp.to_numpy(xp.float32(xp.concat(scores)))) if scores else None
        n = self._kept(confidences, len(tokens))
        return self._out(tokens[:n], None, confidences, n)

    def _sampled(self, hidden: Any, base: Any, anchor: int) -> Draft:
        """Each slot drawn on the host from q; a slot below the threshold is never drawn."""
        xp = self.arrays
        previous, tokens, rows, confidences = xp.asarray([anchor]), [], [], []
        for slot in range(hidden.shape[0]):
            logits, score = self._slot(hidden[slot:slot + 1], base[slot:slot + 1], previous)
            if score is not None:
                confidences.append(float(_sigmoid(xp.to_numpy(xp.float32(score)))[0]))
                if confidences[-1] < self.threshold:
                    break
            q = warp(xp.to_numpy(xp.float32(logits))[0].astype(np.float64), self._params)
            tokens.append(sample(q, self._rng))
            rows.append(q)
            previous = xp.asarray([tokens[-1]])
        n = len(tokens)
        return self._out(tokens, np.stack(rows) if rows else None,
                         np.array(confidences) if confidences else None, n)

    def _kept(self, confidences: np.ndarray | None, n: int) -> int:
        """Slots before the first whose confidence is below the threshold."""
        if confidences is None:
            return n
        below = np.flatnonzero(confidences < self.threshold)
        return int(below[0]) if below.size else n

    def _out(self, tokens: list[int], probs: np.ndarray | None,
             confidences: np.ndarray | None, n: int) -> Draft:
        survival = () if confidences is None else \
            tuple(float(s) for s in np.cumprod(confidences[:n]))
        return Draft(tokens=tuple(tokens), probs=probs, source=self.name, survival=survival)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
