"""DFlash block drafting (z-lab, arXiv 2602.06036; DFlash 2: PyPI dflash 0.1.0), written once
for every backend over the array adapter of backends/arrays.

Knows: the Drafter protocol and its StepFeeds, the block layout, the drafter's context cache
and how it follows the accepted rows, the choice of drafts (argmax; DFlash 2's candidate
selector walk and its q), HEADS.md §3.2-3.3 and §11.5. Must not know: an array library, the
weight modules' computations (a backend's `model(features, block, first_position, cache)` ->
(normed block rows, keys/values per layer as [heads, rows, dim] pairs)), the checkpoint
format, verification, the engine's loop.

`target_layer_ids` name layer OUTPUTS (HF hidden_states[id + 1]); both sessions' capture
hooks return each layer's output, so the ids are captured as they are. The target features
of committed rows (the feeds that arrived since the last block) enter every draft layer only
as keys and values; the block [pending, mask, ..., mask] of k + 1 rows attends to them, to
the cached context and to itself, and its rows 1..k, through the target's output layer, are
the k drafts (row j fills the mask at j). The cache then keeps the context keys only (the
block's rows are cropped), so it holds exactly the rows the verifies kept. k is capped by the
block size minus one.

DFlash 1 drafts each row's argmax (q one-hot: lossless when sampled). DFlash 2's selector
scores slot j's top-K candidates of the target head as unary logit + <A[previous] * P h_j,
B[candidate]>, previous being the anchor for slot 0, then the candidate walked to: argmax
when greedy (left on the device, read back once per block), else a draw from
softmax(scores / T), whose row over the vocabulary (zeros off the candidates) is the q the
engine's rejection test needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from app.core.protocols import StepFeed
from app.core.sampling import sample
from app.core.types import Draft, SamplingParams
from backends.arrays import Arrays


class BlockDrafter:
    """Drafts up to block_size - 1 tokens per step from the context features it has read.

    model: a backend's DFlash weight module (its `candidate_selector`, when not None, holds
    DFlash 2's `predecessor_codebook`, `successor_codebook`, `hidden_projection` and `shape`);
    embed and lm_head: the target's input embedding and output layer.
    """

    name = "dflash"

    def __init__(self, model: Any, arrays: Arrays, *, layer_ids: Sequence[int],
                 block_size: int, mask_token_id: int, embed: Callable[[Any], Any],
                 lm_head: Callable[[Any], Any], embed_scale: float = 1.0) -> None:
        self.model, self.arrays = model, arrays
        self.capture_layers = tuple(layer_ids)  # layer outputs: hidden_states[id + 1] in HF
        self.block_size, self.mask_token_id, self.embed_scale = block_size, mask_token_id, \
            embed_scale
        self.embed, self.lm_head = embed, lm_head
        self._cache: list[tuple[Any, Any]] = []
        self._pending: list[StepFeed] = []  # feeds whose rows the cache does not hold yet
        self._params, self._rng = SamplingParams(), np.random.default_rng()

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: Any) -> None:
        # a reused prompt prefix is not re-read: the context starts at the feed's first row
        self._cache, self._pending = [], []
        self._params, self._rng = params, rng if rng is not None else np.random.default_rng()
        self.accept(feed)

    @property
    def max_drafts(self) -> int:
        """Drafts one block gives: its rows after the pending token's."""
        return self.block_size - 1

    def propose(self, context: Sequence[int], k: int) -> Draft:
        k = min(k, self.max_drafts)
        if k < 1 or not self._pending:
            return Draft()
        xp, start, anchor = self.arrays, self._pending[0].start, int(context[-1])
        rows = self._rows(k)
        with xp.context():
            features = xp.concat([self._features(feed) for feed in self._pending])
            block = self.embed(xp.asarray([anchor, *[self.mask_token_id] * (rows - 1)])) \
                * self.embed_scale
            out, kv = self.model(features, block, start, self._cache)
            draft = self._draft(out, anchor, k)
        # the cache keeps the context's keys, never the block's
        self._cache = [(key[:, :-rows], value[:, :-rows]) for key, value in kv]
        self._pending = []
        return draft

    def _rows(self, k: int) -> int:
        """The block's rows for k drafts: the pending token's and k masks."""
        return k + 1

    def _draft(self, out: Any, anchor: int, k: int) -> Draft:
        """The drafts of the block's output rows (the pending token's row is no draft)."""
        tokens, probs = self._choose(out[1:], anchor)
        return Draft(tokens=tokens, probs=probs, source=self.name)

    def accept(self, feed: StepFeed) -> None:
        # the pending token's row and the accepted drafts' rows join the context
        if all(i in feed.captured for i in self.capture_layers):
            self._pending.append(feed)

    def _features(self, feed: StepFeed) -> Any:
        return self.arrays.concat([feed.hidden_states[i] for i in self.capture_layers], axis=-1)

    def _choose(self, hidden: Any, anchor: int) -> tuple[tuple[int, ...], np.ndarray | None]:
        """The drafts of the slots' hidden rows: DFlash 1 takes each argmax (q one-hot);
        DFlash 2's selector walks the candidates from the anchor."""
        logits = self.lm_head(hidden)
        selector = getattr(self.model, "candidate_selector", None)
        if selector is None:
            return _ints(self.arrays.to_numpy(self.arrays.argmax(logits)[:, 0])), None
        return walk(self.arrays, selector, hidden, logits, anchor, self._params, self._rng)


def walk(xp: Arrays, selector: Any, hidden: Any, logits: Any, anchor: int,
         params: SamplingParams, rng: np.random.Generator
         ) -> tuple[tuple[int, ...], np.ndarray | None]:
    """hidden [k, H] and logits [k, V] of the draft slots -> the k tokens DFlash 2's selector
    walks and, when sampling, q [k, V] (each row given the tokens before it); None when
    greedy."""
    shape, vocab = selector.shape, logits.shape[-1]
    shaped = logits * shape.output_multiplier  # the target head's logits as trained on
    if shape.softcap > 0:
        shaped = xp.tanh(shaped / shape.softcap) * shape.softcap
    unary, candidates = xp.top_k(shaped, min(shape.top_k, vocab))
    projected = selector.hidden_projection(hidden)
    successors = selector.successor_codebook[candidates]  # [k, K, r]
    previous: Any = anchor
    walked, rows = [], []
    for slot in range(hidden.shape[0]):
        scores = unary[slot] + successors[slot] @ (selector.predecessor_codebook[previous]
                                                   * projected[slot])
        if params.greedy:  # the walk stays on the device
            previous = candidates[slot][xp.argmax(scores)[0]]
            walked.append(previous)
            continue
        index, row = _draw(xp.to_numpy(scores), xp.to_numpy(candidates[slot]), vocab,
                           params, rng)
        previous = index
        walked.append(index)
        rows.append(row)
    if params.greedy:
        return _ints(xp.to_numpy(xp.stack(walked))), None
    return tuple(walked), np.stack(rows)


def _draw(scores: np.ndarray, candidates: np.ndarray, vocab: int, params: SamplingParams,
          rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """A candidate drawn from softmax(scores / T), and that law as a row over the vocabulary."""
    x = scores.astype(np.float64) / params.temperature
    q = np.exp(x - x.max())
    q /= q.sum()
    row = np.zeros(vocab)
    row[candidates] = q
    return int(candidates[sample(q, rng)]), row


def _ints(values: np.ndarray) -> tuple[int, ...]:
    return tuple(int(t) for t in values.tolist())
