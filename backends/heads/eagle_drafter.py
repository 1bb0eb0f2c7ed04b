"""EagleDrafter: an EAGLE head drafts chains or EAGLE-2 dynamic trees from the target's own
hidden states, which the engine's verify forwards capture (no extra target forward). Written
once for both backends, over backends/arrays.

Knows: the Drafter protocol, the head API both backends' head modules share (`project`,
`head(embeds, hidden, positions, past, mask)`, `logits`, `feedback`, `to_target`,
`own_embedding`, EAGLE-1's `use_target_head`), the shared sampling pipeline, the EAGLE-2 tree
rule (../shared/docs/HEADS.md 2.2: top-k children per frontier node, a new frontier of the k
best cumulative log-probabilities per depth, the node budget filled by reranking every
candidate); the head's rows are kept by backends/heads/head_rows.py. Must not know: an array
library, verification, the target's cache.

Alignment (HEADS.md 1.2, 1.3): the head row at position t reads the target's state at t and
the embedding of token t + 1; its output scores token t + 2. The head's KV cache holds only
rows built from target states, so it follows the accepted path: the verify forward's states
for the pending token and the accepted drafts arrive in `accept` and are read at the next
`propose`, whose context supplies their tokens (the drafted rows of a step never stay).
Sampled chains report q over the target vocabulary; trees are deterministic (top-k), so
their q is one-hot and the recursive rejection rule keeps the target's distribution.

Host reads (arrays.to_numpy): a greedy chain keeps its tokens on the device and reads them
once, plus the head's probability of each token when a confidence cut is set; a sampled
chain reads each step's logits; a tree reads each depth's top-k once for all its nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from app.core.sampling import sample, warp
from app.core.types import Draft, SamplingParams
from backends.arrays import Arrays
from backends.heads.eagle_format import EagleSpec
from backends.heads.head_rows import HeadRows

TREE_TOP_K = 4  # children per frontier node and frontier width (EAGLE-2's top_k)
TREE_NODES = 16  # node budget: a verify of 17 rows stays row-exact on CPU


@dataclass(frozen=True)
class TargetParts:
    """What a head reads of its target: the input embedding (ids [B, T] -> [B, T, H]), the
    final norm and output layer (EAGLE-1/2 read hs[N] post-norm and score through the target's
    output layer; None where a target has no final norm to lend), the sizes."""

    embed: Callable[[Any], Any]
    norm: Callable[[Any], Any] | None
    output: Callable[[Any], Any]
    vocab_size: int
    n_layers: int


@dataclass(frozen=True)
class _Candidate:
    """A tree node before selection: cumulative log-probability, depth, parent, token."""

    score: float
    depth: int
    parent: int  # index into the candidate list, -1 for a child of the pending token
    token: int  # target id


class Choice(NamedTuple):
    """One chain token: on the device ([1] target id), on the host when sampled (it was read
    to sample it), q over the target vocabulary when sampled, the head's probability of it."""

    token: Any
    picked: int | None
    q: np.ndarray | None
    p: float


class EagleDrafter(HeadRows):
    """Drafts with an EAGLE-3 or EAGLE-1/2 head; tree=True drafts EAGLE-2 dynamic trees."""

    def __init__(self, head: Any, spec: EagleSpec, arrays: Arrays, target: TargetParts, *,
                 tree: bool = False, top_k: int = TREE_TOP_K, max_nodes: int = TREE_NODES,
                 min_confidence: float = 0.0) -> None:
        self.head, self.spec, self.arrays = head, spec, arrays
        self.min_confidence = min_confidence  # a chain stops below this (HeadRows.confident)
        self.tree, self.top_k, self.max_nodes = tree, top_k, max_nodes
        self.name = spec.kind + ("-tree" if tree else "")
        self._hs = spec.hs_ids(target.n_layers)
        # the engine's hook on layer L returns its output: hidden-state index L + 1
        self.capture_layers = tuple(sorted({i - 1 for i in self._hs}))
        own = head.own_embedding()
        self._embed = own if own is not None else target.embed
        self._final_norm = target.norm if spec.kind == "eagle" else None  # EAGLE-1 reads hs[N]
        if spec.kind == "eagle":
            head.use_target_head(target.output)
        self._vocab = int(target.vocab_size)
        with arrays.context():  # target id of each draft-vocabulary row, for sampled q
            self._targets = arrays.to_numpy(head.to_target(arrays.arange(
                0, spec.draft_vocab_size)))
        self._params, self._rng = SamplingParams(), np.random.default_rng()
        self._reset()

    def propose(self, context: Sequence[int], k: int) -> Draft:
        context = [int(t) for t in context]
        if not self._can_draft(context):
            return Draft()
        with self.arrays.context():
            self._read_pending(context)
            if k <= 0 or self._root is None:
                return Draft()
            if self.tree:
                return self._draft_tree(k)
            return self._draft_chain(k)

    # ------------------------------------------------------------------ the head's cache

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
        tokens = self.arrays.asarray([following])
        h, past = self.head(self._embed(tokens), hidden, self.arrays.arange(start, end)[None],
                            self._past)
        self._commit(context, start, end, past,
                     (self.head.logits(h[0, -1]), self.head.feedback(h[0, -1])))
        self.arrays.evaluate(self._root, self._past)  # past steps' rows are built once

    # ------------------------------------------------------------------ chains

    def _draft_chain(self, k: int) -> Draft:
        logits, feedback = self._root
        position = self._next  # the pending token's position: the first draft row's
        past = self._past
        chosen: list[Choice] = []
        reach = 1.0
        for j in range(k):
            choice = self._choose(logits)
            chosen.append(choice)
            reach *= choice.p
            if j == k - 1 or not self.confident(reach):
                break
            h, past = self.head(self._embed(choice.token[None]), feedback[None, None],
                                self.arrays.arange(position, position + 1)[None], past)
            position += 1
            logits, feedback = self.head.logits(h[0, -1]), self.head.feedback(h[0, -1])
            self.arrays.schedule(logits, feedback)
        if self._params.greedy:  # the chain leaves the device once
            tokens = self.arrays.to_numpy(self.arrays.concat([c.token for c in chosen]))
            return Draft(tokens=tuple(int(t) for t in tokens), source=self.name)
        return Draft(tokens=tuple(c.picked for c in chosen),
                     probs=np.stack([c.q for c in chosen]), source=self.name)

    def _choose(self, draft_logits: Any) -> Choice:
        """Argmax when greedy (left on the device); else a sample from q over the target
        vocabulary. The head's probability of the token is read only under a cut."""
        arrays = self.arrays
        if self._params.greedy:
            best = arrays.argmax(draft_logits)
            p = 1.0 if not self.min_confidence else float(arrays.to_numpy(
                arrays.softmax(arrays.float32(draft_logits))[best])[0])
            return Choice(self.head.to_target(best), None, None, p)
        full = np.full(self._vocab, -np.inf, dtype=np.float32)
        full[self._targets] = arrays.to_numpy(arrays.float32(draft_logits))
        q = warp(full, self._params)
        token = sample(q, self._rng)
        return Choice(arrays.asarray([token]), token, q, float(q[token]))

    # ------------------------------------------------------------------ EAGLE-2 trees

    def _draft_tree(self, k: int) -> Draft:
        arrays = self.arrays
        logits, feedback = self._root
        candidates: list[_Candidate] = []
        inputs: dict[int, Any] = {}  # hidden each frontier node is fed with
        frontier = self._grow(candidates, inputs, [-1], 1, logits[None], feedback[None])
        past, fed_rows, n_base = self._past, {}, len(self._rows)
        for depth in range(2, k + 1):
            nodes = frontier
            # tokens and positions [2, nodes] in one copy to the device
            rows = arrays.asarray([[candidates[i].token for i in nodes],
                                   [self._next + depth - 2] * len(nodes)])
            ids, positions = rows[0:1], rows[1:2]
            hidden = arrays.stack([inputs[i] for i in nodes])[None]
            mask = arrays.asarray(_tree_mask(nodes, candidates, fed_rows, n_base), "bool")
            for node in nodes:
                fed_rows[node] = len(fed_rows)
            h, past = self.head(self._embed(ids), hidden, positions, past, mask)
            new = self._grow(candidates, inputs, nodes, depth, self.head.logits(h[0]),
                             self.head.feedback(h[0]))  # one matmul for every node
            frontier = sorted(new, key=lambda i: -candidates[i].score)[:self.top_k]
        return self._select(candidates)

    def _grow(self, candidates: list[_Candidate], inputs: dict[int, Any], parents: list[int],
              depth: int, logits: Any, feedback: Any) -> list[int]:
        """Each parent's top-k children (rows of logits: one per parent) appended to
        candidates, fed the parent's feedback row next; their indices. One host read."""
        arrays = self.arrays
        top = min(self.top_k, logits.shape[-1])
        values, draft_ids = arrays.top_k(arrays.log_softmax(arrays.float32(logits)), top)
        values, targets = arrays.to_numpy(values), arrays.to_numpy(self.head.to_target(draft_ids))
        new: list[int] = []
        for row, parent in enumerate(parents):
            score = candidates[parent].score if parent >= 0 else 0.0
            for value, token in zip(values[row].tolist(), targets[row].tolist()):
                inputs[len(candidates)] = feedback[row]
                new.append(len(candidates))
                candidates.append(_Candidate(score + float(value), depth, parent, int(token)))
        return new

    def _select(self, candidates: list[_Candidate]) -> Draft:
        """The node budget filled by cumulative log-probability, ancestor-closed, parents
        first (EAGLE-2's reranking)."""
        ranked = sorted(range(len(candidates)),
                        key=lambda i: (-candidates[i].score, candidates[i].depth, i))
        kept: set[int] = set()
        for i in ranked:
            if len(kept) == self.max_nodes:
                break
            parent = candidates[i].parent
            if parent < 0 or parent in kept:  # a child never outranks its parent but for ties
                kept.add(i)
        order = sorted(kept, key=lambda i: (candidates[i].depth, i))
        index = {old: new for new, old in enumerate(order)}
        parents = tuple(index[candidates[i].parent] if candidates[i].parent >= 0 else -1
                        for i in order)
        return Draft(tokens=tuple(candidates[i].token for i in order), parents=parents,
                     source=self.name)


def _tree_mask(nodes: list[int], candidates: list[_Candidate], fed_rows: dict[int, int],
               n_base: int) -> np.ndarray:
    """[nodes, base + fed + nodes]: the committed rows, each node's fed ancestors, itself."""
    n_fed = len(fed_rows)
    mask = np.zeros((len(nodes), n_base + n_fed + len(nodes)), dtype=bool)
    mask[:, :n_base] = True
    for row, node in enumerate(nodes):
        mask[row, n_base + n_fed + row] = True
        parent = candidates[node].parent
        while parent >= 0:
            mask[row, n_base + fed_rows[parent]] = True
            parent = candidates[parent].parent
    return mask
