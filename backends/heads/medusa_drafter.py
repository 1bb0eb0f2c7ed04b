"""Medusa heads (FasterDecoding/Medusa, arXiv 2401.10774) as a tree drafter over the target,
written once for every backend over the array adapter of backends/arrays.

Knows: the head math, the static tree of top-ranked choices, the Drafter protocol. Must not
know: an array library, the weight modules' storage (each backend's `heads/medusa.py` holds
`blocks` and `heads`, lists of linear layers, with `n_heads`, `n_layers`), the folder format
(backends/heads/medusa_format.py), surfaces, the engine's loop.

Head i (0-based) reads the target's last hidden state after the final norm at position t and
predicts the token at t + 2 + i (the target's own head predicts t + 1, the pending token):
`lm_i(R^L(h))` with `R(x) = x + SiLU(W x + b)`. The reference repeats ONE ResBlock module L
times (`[ResBlock(H)] * L`), so every layer of a head shares its weights; published heads
have L = 1. There is no draft forward: each verify forward's captured last layer, at the
row of the last accepted token, gives the next tree. Drafts are each head's top-ranked
tokens, deterministic (q one-hot), so the verifier's rule for distinct deterministic
children keeps sampling exact (Medusa's own "typical acceptance" would not be lossless).
Host reads: one per step, every head's top-ranked tokens (arrays.to_numpy).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

from app.core.protocols import StepFeed
from app.core.types import Draft, SamplingParams, SpecdeckError
from backends.arrays import Arrays

TOP_RANKS = 4  # candidates per head the default tree draws from
TREE_NODES = 16  # default tree size: verify rows stay within the exact blocks


def default_choices(n_heads: int, max_nodes: int = TREE_NODES,
                    ranks: int = TOP_RANKS) -> tuple[tuple[int, ...], ...]:
    """A static tree: paths of head ranks (rank r of head d at depth d + 1), most likely first.

    A path scores the product of 1 / (rank + 1) over its depths times 0.6 per depth (a head
    further ahead is right less often); the best max_nodes paths are taken best-first, so a
    path's parent is always in. Sorted by (length, ranks) as Medusa's choice lists are.
    """
    frontier = [(-0.6, (0,))] + [(-0.6 / (r + 1), (r,)) for r in range(1, ranks)]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < max_nodes:
        score, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < n_heads:
            for r in range(ranks):
                heapq.heappush(frontier, (score * 0.6 / (r + 1), (*path, r)))
    return tuple(sorted(chosen, key=lambda p: (len(p), p)))


def medusa_logits(heads: Any, arrays: Arrays, hidden: Any) -> Any:
    """[..., hidden] post-norm target states -> [n_heads, ..., vocab] logits."""
    out = []
    for block, head in zip(heads.blocks, heads.heads):
        x = hidden
        for _ in range(heads.n_layers):
            x = x + arrays.silu(block(x))
        out.append(head(x))
    return arrays.stack(out)


class MedusaDrafter:
    """Drafts a static tree of Medusa candidates read at the last accepted row; norm: the
    target's final norm, n_layers: the target's (its last is captured)."""

    name = "medusa"

    def __init__(self, heads: Any, arrays: Arrays, norm: Callable[[Any], Any], n_layers: int,
                 choices: Sequence[tuple[int, ...]] | None = None) -> None:
        self.heads, self.arrays, self.norm = heads, arrays, norm
        self.capture_layers = (n_layers - 1,)
        self.choices = tuple(choices or default_choices(heads.n_heads))
        if any(len(c) > heads.n_heads for c in self.choices):
            raise SpecdeckError(f"a Medusa tree path is deeper than the {heads.n_heads} heads")
        self._ranks = max((p[-1] for p in self.choices), default=0) + 1
        self._top: list[list[int]] | None = None  # per head, its tokens by rank

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: Any) -> None:
        self._read(feed)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self._top is None:
            return Draft()
        index: dict[tuple[int, ...], int] = {}
        tokens, parents = [], []
        for path in self.choices:
            if len(path) > k or path[:-1] not in index and len(path) > 1:
                continue
            index[path] = len(tokens)
            tokens.append(self._top[len(path) - 1][path[-1]])
            parents.append(index[path[:-1]] if len(path) > 1 else -1)
        return Draft(tokens=tuple(tokens), parents=tuple(parents), source=self.name)

    def accept(self, feed: StepFeed) -> None:
        self._read(feed)

    def _read(self, feed: StepFeed) -> None:
        """The next tree's candidates, from the state at the feed's last row."""
        hidden = feed.captured.get(self.capture_layers[0])
        if hidden is None:
            self._top = None
            return
        xp = self.arrays
        with xp.context():
            state = self.norm(hidden[feed.rows[-1]][None])
            logits = medusa_logits(self.heads, xp, state)[:, 0]  # [n_heads, vocab]
            top = xp.to_numpy(xp.top_k(logits, self._ranks)[1])
        self._top = top.tolist()
