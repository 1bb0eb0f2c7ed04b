"""EagleDrafter: an EAGLE head drafts chains or EAGLE-2 dynamic trees from the target's own
hidden states, which the engine's verify forwards capture (no extra target forward).

Knows: the Drafter protocol, the head API of backends/torch/heads/eagle.py, the shared
sampling pipeline, the EAGLE-2 tree rule (../shared/docs/HEADS.md 2.2: top-k children per
frontier node, a new frontier of the k best cumulative log-probabilities per depth, the node
budget filled by reranking every candidate); the head's rows are kept by backends/heads/head_rows.py.
Must not know: verification, the target's cache.

Alignment (HEADS.md 1.2, 1.3): the head row at position t reads the target's state at t and
the embedding of token t + 1; its output scores token t + 2. The head's KV cache holds only
rows built from target states, so it follows the accepted path: the verify forward's states
for the pending token and the accepted drafts arrive in `accept` and are read at the next
`propose`, whose context supplies their tokens (the drafted rows of a step never stay).
Sampled chains report q over the target vocabulary; trees are deterministic (top-k), so
their q is one-hot and the recursive rejection rule keeps the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.core.sampling import sample, warp
from app.core.types import Draft, SamplingParams
from backends.heads.head_rows import HeadRows
from backends.heads.eagle_format import EagleSpec

TREE_TOP_K = 4  # children per frontier node and frontier width (EAGLE-2's top_k)
TREE_NODES = 16  # node budget: a verify of 17 rows stays row-exact on CPU


@dataclass(frozen=True)
class _Candidate:
    """A tree node before selection: cumulative log-probability, depth, parent, token."""

    score: float
    depth: int
    parent: int  # index into the candidate list, -1 for a child of the pending token
    token: int  # target id


class EagleDrafter(HeadRows):
    """Drafts with an EAGLE-3 or EAGLE-1/2 head; tree=True drafts EAGLE-2 dynamic trees."""

    def __init__(self, target: Any, head: torch.nn.Module, spec: EagleSpec, tree: bool = False,
                 top_k: int = TREE_TOP_K, max_nodes: int = TREE_NODES,
                 min_confidence: float = 0.0) -> None:
        self.head, self.spec = head, spec
        self.min_confidence = min_confidence  # a chain stops below this (HeadRows.confident)
        self.tree, self.top_k, self.max_nodes = tree, top_k, max_nodes
        self.name = spec.kind + ("-tree" if tree else "")
        self._hs = spec.hs_ids(target.n_layers)
        # the engine's hook on layer L returns its output: hidden-state index L + 1
        self.capture_layers = tuple(sorted({i - 1 for i in self._hs}))
        hf = target.hf
        self._embed = head.embed_tokens if head.embed_tokens is not None else \
            hf.get_input_embeddings()
        self._final_norm = hf.model.norm if spec.kind == "eagle" else None
        if spec.kind == "eagle":
            head.use_target_head(hf.get_output_embeddings())
        self._vocab = int(target.vocab_size)
        self._device = target.device
        self._params, self._rng = SamplingParams(), np.random.default_rng()
        self._reset()

    def propose(self, context: Sequence[int], k: int) -> Draft:
        context = [int(t) for t in context]
        if not self._can_draft(context):
            return Draft()
        with torch.inference_mode():
            self._read_pending(context)
            if k <= 0 or self._root is None:
                return Draft()
            if self.tree:
                return self._draft_tree(k)
            return self._draft_chain(k)

    # ------------------------------------------------------------------ the head's cache

    def _join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts)

    def _read_pending(self, context: list[int]) -> None:
        """Run the head over the target states that arrived since the last propose."""
        pending = self._take_pending()
        if pending is None:
            return
        layers, following, start = pending
        end = start + len(following)
        features = [layers[i - 1] for i in self._hs]
        if self._final_norm is not None:
            features = [self._final_norm(f) for f in features]  # EAGLE-1 reads hs[N]
        hidden = self.head.project(features)[None]
        tokens = torch.tensor([following], device=self._device)
        positions = torch.arange(start, end, device=self._device)[None]
        h, past = self.head(self._embed(tokens), hidden, positions, self._past)
        self._commit(context, start, end, past,
                     (self.head.logits(h[0, -1]), self.head.feedback(h[0, -1])))

    # ------------------------------------------------------------------ chains

    def _draft_chain(self, k: int) -> Draft:
        logits, feedback = self._root
        position = self._next  # the pending token's position: the first draft row's
        past = self._past
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        reach = 1.0
        for j in range(k):
            token, q, p = self._choose(logits)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            reach *= p
            if j == k - 1 or not self.confident(reach):
                break
            ids = torch.tensor([[token]], device=self._device)
            h, past = self.head(self._embed(ids), feedback[None, None],
                                torch.tensor([[position]], device=self._device), past)
            position += 1
            logits, feedback = self.head.logits(h[0, -1]), self.head.feedback(h[0, -1])
        return Draft(tokens=tuple(tokens), probs=np.stack(probs) if probs else None,
                     source=self.name)

    def _choose(self, draft_logits: torch.Tensor) -> tuple[int, np.ndarray | None, float]:
        """Argmax when greedy; else a sample from q over the target vocabulary (q returned);
        with the head's probability of the token chosen."""
        if self._params.greedy:
            best = draft_logits.argmax(-1, keepdim=True)
            p = 1.0 if not self.min_confidence else \
                float(torch.softmax(draft_logits.float(), -1)[best])
            return int(self.head.to_target(best)[0]), None, p
        full = np.full(self._vocab, -np.inf, dtype=np.float32)
        ids = self.head.to_target(torch.arange(draft_logits.shape[-1],
                                               device=self._device)).cpu().numpy()
        full[ids] = draft_logits.float().cpu().numpy()
        q = warp(full, self._params)
        token = sample(q, self._rng)
        return token, q, float(q[token])

    # ------------------------------------------------------------------ EAGLE-2 trees

    def _draft_tree(self, k: int) -> Draft:
        logits, feedback = self._root
        top = self.top_k
        candidates: list[_Candidate] = []
        children = self._children(logits, 0.0, -1, 1, top)
        candidates.extend(children)
        frontier = list(range(len(candidates)))
        inputs = {i: feedback for i in frontier}  # hidden each frontier node is fed with
        past, fed_rows, n_base = self._past, {}, len(self._rows)
        for depth in range(2, k + 1):
            nodes = frontier
            ids = torch.tensor([[candidates[i].token for i in nodes]], device=self._device)
            hidden = torch.stack([inputs[i] for i in nodes])[None]
            positions = torch.full((1, len(nodes)), self._next + depth - 2,
                                   device=self._device)
            mask = self._tree_mask(nodes, candidates, fed_rows, n_base)
            for node in nodes:
                fed_rows[node] = len(fed_rows)
            h, past = self.head(self._embed(ids), hidden, positions, past, mask)
            logits, feedback = self.head.logits(h[0]), self.head.feedback(h[0])  # one matmul
            new: list[int] = []
            for row, node in enumerate(nodes):
                for kid in self._children(logits[row], candidates[node].score, node, depth,
                                          top):
                    inputs[len(candidates)] = feedback[row]
                    new.append(len(candidates))
                    candidates.append(kid)
            frontier = sorted(new, key=lambda i: -candidates[i].score)[:top]
        return self._select(candidates)

    def _children(self, logits: torch.Tensor, score: float, parent: int, depth: int,
                  top: int) -> list[_Candidate]:
        logp = torch.log_softmax(logits.float(), dim=-1)
        values, draft_ids = logp.topk(min(top, logp.shape[-1]))
        targets = self.head.to_target(draft_ids).tolist()
        return [_Candidate(score + float(v), depth, parent, int(t))
                for v, t in zip(values.tolist(), targets)]

    def _tree_mask(self, nodes: list[int], candidates: list[_Candidate],
                   fed_rows: dict[int, int], n_base: int) -> torch.Tensor:
        """[nodes, base + fed + nodes]: the committed rows, each node's fed ancestors, itself."""
        n_fed = len(fed_rows)
        mask = torch.zeros(len(nodes), n_base + n_fed + len(nodes), dtype=torch.bool,
                           device=self._device)
        mask[:, :n_base] = True
        for row, node in enumerate(nodes):
            mask[row, n_base + n_fed + row] = True
            parent = candidates[node].parent
            while parent >= 0:
                mask[row, n_base + fed_rows[parent]] = True
                parent = candidates[parent].parent
        return mask

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
