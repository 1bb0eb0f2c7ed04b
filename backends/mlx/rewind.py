"""Cutting back an mlx-lm prompt cache that keeps more than plain KV rows: a sliding window
(mlx-lm's RotatingKVCache overwrites its oldest rows) and a recurrent layer's state
(ArraysCache: Gated DeltaNet's and Mamba's conv input and recurrent state).

Windows: WindowCache stands in for a RotatingKVCache and keeps, in order, at least the last
window - 1 + SPARE rows, so any cut of up to SPARE rows still leaves a full window behind
(issue 45's "window + k spare rows"); its mask applies the window.

Recurrent states: snapshot, then re-decode. A layer's forward replaces its state arrays
(`cache[i] = new`) and MLX arrays are values, so a checkpoint taken before a forward holds
references, not copies, and stays valid after it. A rewind restores the newest checkpoint at
or below the kept length; the session trims the KV layers to it and re-decodes the tokens in
between (none when the checkpoint is the kept length: every one-row forward leaves one).
A session holds at most MAX_CHECKPOINTS states per recurrent layer beside the live one, and
after a rewind only the one it restored.

Knows: mlx-lm's cache classes (KVCache, RotatingKVCache, ArraysCache, CacheList) and their
fields.
Must not know: tokens, models, drafting, verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

SPARE = 64  # rows a window keeps past its size: the longest verify or draft a cut undoes
# per session, each a state per recurrent layer: a draft model's k one-row forwards (k <= 8)
# rewind without a re-decode; a rewind older than these replays from the start
MAX_CHECKPOINTS = 9

# why these targets verify chains only on MLX, named in tree refusals
RECURRENT_CHAINS = ("its recurrent layers keep one state, rewound along a chain by a "
                    "checkpoint and a re-decode on MLX (no tree)")
WINDOW_CHAINS = ("its sliding-window layers keep the last keys of one chain, rewound along "
                 "it (no tree)")


class WindowCache(KVCache):
    """A sliding window's KV rows, in order, with SPARE rows to cut back; offset stays the
    absolute position (RoPE reads it), rows before `start` are dropped."""

    def __init__(self, window: int, spare: int = SPARE) -> None:
        super().__init__()
        self.window, self.spare, self.start = window, spare, 0

    @property
    def stored(self) -> int:
        return self.offset - self.start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._drop_front(keys.shape[2])
        # KVCache writes and reads its buffer from row 0 up to offset: the rows since start
        self.offset -= self.start
        try:
            return super().update_and_fetch(keys, values)
        finally:
            self.offset += self.start

    def _drop_front(self, rows: int) -> None:
        excess = self._excess(rows)
        if excess:
            self.keys = self.keys[..., excess:self.stored, :]
            self.values = self.values[..., excess:self.stored, :]
            self.start += excess

    def _excess(self, rows: int) -> int:
        """Rows the next forward of `rows` rows drops from the front (its mask reads it too):
        only when the buffer would grow anyway, so the copy is paid once per KVCache.step."""
        excess = self.stored - (self.window - 1 + self.spare)
        if self.keys is None or excess <= 0 or self.stored + rows <= self.keys.shape[2]:
            return 0
        return excess

    def can_trim(self, n: int) -> bool:
        """Whether n rows can go and a full window still stands before the next row."""
        return 0 <= n <= self.stored and (self.start == 0 or self.stored - n >= self.window - 1)

    def trim(self, n: int) -> int:
        if not self.can_trim(n):
            raise ValueError(f"a window of {self.window} rows cannot cut {n} of {self.stored}")
        self.offset -= n
        return n

    def make_mask(self, N: int, window_size: int | None = None,  # noqa: N803 (mlx-lm's name)
                  return_array: bool = False) -> Any:
        window, before = window_size or self.window, self.stored - self._excess(N)
        if before + N <= window and not return_array:
            return None if N == 1 else "causal"
        return create_causal_mask(N, before, window_size=window)

    def size(self) -> int:
        return self.offset


def session_cache(cache: list[Any]) -> list[Any]:
    """mlx-lm's prompt cache with each plain rotating window swapped for a WindowCache."""
    return [WindowCache(c.max_size) if type(c) is RotatingKVCache and c.keep == 0 else c
            for c in cache]


def leaves(cache: list[Any]) -> list[Any]:
    """Each layer's caches, a CacheList opened (Falcon-H1 keeps a Mamba state and KV rows per
    layer in one)."""
    return [leaf for c in cache for leaf in (c.caches if isinstance(c, CacheList) else (c,))]


def cuts(cache: Any, n: int) -> bool:
    """Whether a cache layer can drop its last n rows in place."""
    if isinstance(cache, WindowCache):
        return cache.can_trim(n)
    return n == 0 or (hasattr(cache, "offset") and cache.is_trimmable())


def stateful(cache: list[Any]) -> list[ArraysCache]:
    return [c for c in leaves(cache) if isinstance(c, ArraysCache)]


@dataclass(frozen=True)
class Checkpoint:
    """The recurrent layers' arrays before a forward at `length` tokens (references)."""

    length: int
    states: tuple[tuple[Any, ...], ...]


class Checkpoints:
    """Checkpoints of one cache's recurrent layers, newest last, at most MAX_CHECKPOINTS."""

    def __init__(self, cache: list[Any]) -> None:
        self._layers = stateful(cache)
        self._marks: list[Checkpoint] = []

    @property
    def needed(self) -> bool:
        return bool(self._layers)

    def mark(self, length: int) -> None:
        """Before a forward at `length`: what a rewind to here restores."""
        if self._marks and self._marks[-1].length >= length:
            self.drop_after(length - 1)
        states = tuple((list(c.cache), c.left_padding, c.lengths) for c in self._layers)
        self._marks.append(Checkpoint(length, states))
        del self._marks[:-MAX_CHECKPOINTS]

    def restore(self, length: int) -> int | None:
        """Put back the newest checkpoint at or below length; its length, or None if none."""
        self.drop_after(length)
        if not self._marks:
            return None
        # the re-decode that follows marks it again; older ones go: sessions rewind to what
        # they kept (a far rewind, a new prompt, replays), and each holds a state alive
        mark = self._marks.pop()
        self._marks.clear()
        for layer, (arrays, padding, lengths) in zip(self._layers, mark.states):
            layer.state = (list(arrays), padding, lengths)
        return mark.length

    def drop_after(self, length: int) -> None:
        while self._marks and self._marks[-1].length > length:
            self._marks.pop()

    def clear(self) -> None:
        self._marks.clear()
