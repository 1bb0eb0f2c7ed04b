"""Model-based drafters on MLX: the shared DraftModelDrafter with greedy chains on the device.

Knows: mlx arrays and MlxSession.logits (lazy device logits). Must not know: verification or
the target's cache. Everything but the greedy chain is app/drafters/draft_model.py's: greedy
drafts are fed back as lazy device arrays and read back once per step, not once per token.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from app.drafters.draft_model import DraftModelDrafter as _SharedDrafter


class DraftModelDrafter(_SharedDrafter):
    """Drafts k tokens with a small MLX model; greedy chains stay on the device."""

    def _draft(self, feed: list[int], k: int) -> tuple[list[int], np.ndarray | None]:
        if not self._params.greedy or self.min_confidence:
            return super()._draft(feed, k)
        step: mx.array | list[int] = feed
        chosen = []
        for _ in range(k):
            logits = self._session.logits(step, n_logits=1)[-1, :self._vocab]
            step = mx.argmax(logits, keepdims=True)
            mx.async_eval(step)
            chosen.append(step)
        # every draft token but the last went into the cache (the session noted them lazily)
        return mx.concatenate(chosen).tolist(), None
