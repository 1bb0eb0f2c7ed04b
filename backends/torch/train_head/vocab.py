"""The draft vocabulary of an EAGLE-3 head: the target's most frequent tokens in its own answers.

Knows: the EAGLE-3 mapping (HEADS.md 0.2; SafeAILab/EAGLE `traineagle3/cnets.py scandata`):
the chosen ids sorted ascending, `d2t[i] = ids[i] - i` (target id = draft id + d2t), `t2d` a
mask over the target vocabulary. Must not know: array libraries other than numpy, files.
"""

from __future__ import annotations

import numpy as np

from app.core.types import SpecdeckError

ROWS_MULTIPLE = 64  # output-layer rows in whole blocks for the matmul kernels


def draft_vocabulary(counts: np.ndarray, size: int, multiple: int = ROWS_MULTIPLE) -> np.ndarray:
    """At most `size` of the most frequent token ids (ties: the lower id), sorted ascending.

    Only tokens the answers hold, rounded up to `multiple` rows: a token never seen in training
    is never the head's right guess (a SmolLM2 head cut from 32,000 rows to the 4,800 these
    rules keep had the same held-out accuracy and live acceptance; docs/PERFORMANCE.md), while
    every row costs each draft step. The
    rounding takes the lowest ids not chosen yet: byte-pair vocabularies number their
    earliest (most common) merges first, so these are the likeliest unseen tokens."""
    vocab = len(counts)
    if not 0 < size <= vocab:
        raise SpecdeckError(f"--draft-vocab must be between 1 and the target's vocabulary "
                            f"({vocab}); got {size}")
    order = np.lexsort((np.arange(vocab), -counts))  # by count descending, then id
    seen = order[counts[order] > 0][:size]
    rows = min(size, max(multiple, -(-len(seen) // multiple) * multiple))
    rest = np.setdiff1d(np.arange(vocab), seen, assume_unique=True)[:rows - len(seen)]
    return np.sort(np.concatenate([seen, rest]).astype(np.int64))


def d2t_t2d(ids: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The two tensors a head stores for its draft vocabulary `ids` (sorted ascending)."""
    d2t = ids.astype(np.int64) - np.arange(len(ids), dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[ids] = True
    return d2t, t2d


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """Share of the counted tokens the draft vocabulary holds."""
    total = counts.sum()
    return float(counts[ids].sum() / total) if total else 0.0
