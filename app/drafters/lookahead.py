"""Lookahead decoding: Jacobi iteration over a 2-D window plus an n-gram pool; no model.

Knows: token histories, the window's trajectory, the pool, the tree it proposes and which of
that tree's rows hold the next Jacobi iterate. Must not know: models, probabilities (its
drafts are deterministic: q is one-hot, so sampled verification stays exact).

LADE (hao-ai-lab/LookaheadDecoding `lade/decoding.py`, `models/modeling_llama.py`) runs one
forward over the last token, a lookahead branch (the window) and a verification branch (pool
n-grams keyed by the last token). Its window mask is a tree: level 0 is a chain after the last
token (the trunk, column 0 being the last token itself) and column j's levels 1..n-2 hang below
trunk node j as a chain, at consecutive positions. So one step is one draft tree for the
tree verifier: guesses and window share a trie, and a path through window nodes may be
accepted too (the verifier only compares tokens with the target).

After the forward, new[j] = the target's argmax at column j's deepest node (the next Jacobi
iterate); the pool learns (trunk[j] -> level1[j], ..., new[j]) and the window slides one
column: trunk <- level1[1:], level l <- level l+1, last level <- new (LADE's ALWAYS_FWD_ONE).
The first n-2 steps fill the levels (warm-up); the guesses are verified all along.

Depth: a step of k may not draft deeper than k. The deepest window node sits at
(W - 1) + (n - 2) and a guess at n - 1, so a step uses n = min(level, k + 1) and
W = min(window, k - n + 3); when that shape changes the window restarts, the pool stays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.core.protocols import StepFeed
from app.core.types import Draft, SamplingParams


class _Trie:
    """Draft nodes in insertion order; a (parent, token) pair is one node, so guesses and the
    window share the prefixes they agree on (a row's output depends only on its ancestors)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._index: dict[tuple[int, int], int] = {}

    def add(self, parent: int, token: int) -> int:
        key = (parent, token)
        if key not in self._index:
            self._index[key] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
        return self._index[key]

    def draft(self, source: str) -> Draft:
        return Draft(tokens=tuple(self.tokens), parents=tuple(self.parents), source=source)


class NgramPool:
    """key token -> up to `size` continuations, least recently seen first (LADE's token_map)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._map: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        if self.size == 0:
            return
        entries = self._map.setdefault(key, [])
        if continuation in entries:
            entries.remove(continuation)
        elif len(entries) == self.size:
            entries.pop(0)
        entries.append(continuation)

    def guesses(self, key: int) -> list[tuple[int, ...]]:
        """Most recent first."""
        return list(reversed(self._map.get(key, ())))


class LookaheadDrafter:
    """Jacobi window (`level` n-gram size N, `window` W columns) and a pool of `guesses` G
    continuations per key, fed by the window and by every n-gram of the prompt and output."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, level: int = 4, window: int = 5, guesses: int = 4,
                 name: str = "lookahead") -> None:
        if level < 2 or window < 1 or guesses < 0:
            raise ValueError(f"need level >= 2, window >= 1, guesses >= 0 (got {level}, "
                             f"{window}, {guesses})")
        self.level, self.window, self.n_guesses, self.name = level, window, guesses, name
        self.pool = NgramPool(guesses)
        self.levels: list[list[int]] = []  # [trunk (W-1 tokens), level 1 (W), ...]
        self._shape = (0, 0)  # (n, W) the window was built for
        self._indexed = 0  # context n-grams already in the pool
        self._pad_at = 0
        self._context: Sequence[int] = ()
        self._reads: list[int] | None = None  # per column: the node whose row gives new[j]
        self._rows = 0
        self._root = 0

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: np.random.Generator) -> None:
        self.pool = NgramPool(self.n_guesses)
        self.levels, self._shape, self._indexed, self._pad_at = [], (0, 0), 0, 0
        self._reads = None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self._context, self._reads = context, None
        if k < 1 or not context:
            return Draft()
        n = min(self.level, k + 1)
        width = min(self.window, k - n + 3)
        if (n, width) != self._shape:
            self._shape = (n, width)
            self.levels = [[self._pad() for _ in range(width - 1)]]
        self._index_context(context)
        trie = _Trie()
        self._root = int(context[-1])
        for guess in self.pool.guesses(self._root):
            at = -1
            for token in guess[:n - 1]:
                at = trie.add(at, token)
        deepest = [-1]  # column 0 is the pending token: row 0
        for token in self.levels[0]:
            deepest.append(trie.add(deepest[-1], token))
        for tokens in self.levels[1:]:
            deepest = [trie.add(deepest[j], tokens[j]) for j in range(width)]
        self._reads, self._rows = deepest, len(trie.tokens) + 1
        return trie.draft(self.name)

    def accept(self, feed: StepFeed) -> None:
        argmax = feed.argmax  # every row: the window reads rows the verify dropped
        if self._reads is None or len(argmax) != self._rows:
            return  # not the tree this drafter proposed (a chain-only backend cut it)
        new = [int(argmax[node + 1]) for node in self._reads]
        n, width = self._shape
        if len(self.levels) < n - 1:  # warm-up: every level slides, new becomes the next one
            self.levels = [[*tokens[1:], self._pad()] for tokens in self.levels]
            self.levels.append([*new[1:], self._pad()])
            return
        for j in range(width):
            key = self._root if j == 0 else self.levels[0][j - 1]
            self.pool.add(key, (*(tokens[j] for tokens in self.levels[1:]), new[j]))
        lower = [*self.levels[1:], new]
        self.levels = [lower[0][1:], *lower[1:]]

    def _index_context(self, context: Sequence[int]) -> None:
        """Every complete n-gram of the prompt and output joins the pool, once."""
        stop = len(context) - self.level
        for i in range(self._indexed, stop + 1):
            self.pool.add(int(context[i]), tuple(int(t) for t in context[i + 1:i + self.level]))
        self._indexed = max(self._indexed, stop + 1)

    def _pad(self) -> int:
        """A context token, in order (LADE seeds its window with prompt tokens)."""
        if not self._context:
            return 0
        self._pad_at += 1
        return int(self._context[(self._pad_at - 1) % len(self._context)])
