"""TargetOutput: what one target forward returns, as the engine and drafters read it.

Knows: per-row argmax ids, lazily produced host logits, captured hidden states. Must not
know: the array library behind the hidden states (they stay backend arrays), drafters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TargetOutput:
    """Rows of one forward pass: row i scores the token after input i.

    argmax: per-row argmax ids (all greedy needs to leave the device).
    logits: host numpy [rows, vocab] float32, produced lazily by `host_logits`.
    hidden_states: captured layer index -> backend array [input rows, hidden] (every input
    row, not only the last n_logits), for heads; only the layers the forward asked for.
    """

    argmax: tuple[int, ...]
    logits_fn: Any = field(repr=False, default=None)
    hidden_states: Mapping[int, Any] = field(default_factory=dict)

    @property
    def n_rows(self) -> int:
        return len(self.argmax)

    def host_logits(self) -> np.ndarray:
        return self.logits_fn()
