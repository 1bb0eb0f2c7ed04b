"""Suffix drafting (SuffixDecoding): the longest suffix match in the request or the history.

Knows: token records, an index over them (hashes of every window of RUNGS lengths, sorted,
so a lookup is a binary search whatever the history's size), the request's own tokens, and
how a match becomes a draft: the continuations of every occurrence of the longest matched
suffix, weighted by how often each followed (a node's probability is its count over its
parent's), as deep as the match earns (max_spec_factor × match length, at most MAX_DEPTH)
and no deeper than where the estimated probability falls below min_token_prob; each node's
survival is that probability calibrated by MatchOdds (app/drafters/match_odds.py: how often
matches of its length were right in this partition's text), which prices the draft's depth
for the k controller. A tree
(best-first by probability, siblings most likely first, so its first chain is the greedy
path) where the target takes trees, that greedy chain otherwise. Draft.source names where
the match came from: `suffix:request`, `suffix:history` or `suffix:seeded`.
Must not know: files and partitions (app/store/history.py keeps the records; its History
hands this drafter one partition's index), models, probabilities of the target (drafts are
deterministic, q is one-hot).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from app.core.protocols import StepFeed
from app.core.types import Draft, SamplingParams
from app.drafters.match_odds import MatchOdds, Prediction

SEP = np.uint64(2**32 - 1)  # between records: a window holding it never matches a context
RUNGS = (2, 4, 8, 16, 32)  # window lengths the index hashes (the shortest history match: 2)
MAX_MATCH = 64  # a match is measured no further back than this
MAX_HITS = 256  # occurrences of a match read per draft, the most recent ones
MAX_DEPTH = 32  # the deepest draft (engine.MAX_K)
TREE_NODES = 16  # as lookup trees: verify rows stay within the exact blocks
MAX_SPEC_FACTOR = 1.0  # SuffixDecoding's defaults (arctic-inference, vLLM `suffix`)
MIN_TOKEN_PROB = 0.1
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplication by it is a bijection mod 2**64
REQUEST, HISTORY, SEEDED = "request", "history", "seeded"


@dataclass(frozen=True)
class Match:
    """Where the context's longest suffix occurred: `tokens` holds the continuations, each
    starting at one of `starts` and ending at SEP or the array's end."""

    length: int
    tokens: np.ndarray
    starts: np.ndarray
    origin: str


@dataclass(frozen=True)
class SuffixIndex:
    """An immutable index over token records: `added` returns a new one, so a drafter reading
    one while a reply is recorded never sees half an update."""

    tokens: np.ndarray  # uint64: SEP, record, SEP, record, ...
    record_starts: np.ndarray  # int64, where each record begins in tokens
    seeded: np.ndarray  # bool per record
    keys: tuple[np.ndarray, ...]  # per rung, window hashes, sorted (stable: ties by position)
    follows: tuple[np.ndarray, ...]  # per rung, the position after each window

    @classmethod
    def empty(cls) -> SuffixIndex:
        nothing = np.zeros(0, dtype=np.int64)
        return cls(np.array([SEP], dtype=np.uint64), nothing, np.zeros(0, dtype=bool),
                   tuple(np.zeros(0, dtype=np.uint64) for _ in RUNGS),
                   tuple(nothing for _ in RUNGS))

    @classmethod
    def build(cls, records: Sequence[tuple[Sequence[int], bool]]) -> SuffixIndex:
        """records: (tokens, seeded) each, oldest first."""
        return cls.empty().added(records)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) - len(self.record_starts) - 1

    def added(self, records: Sequence[tuple[Sequence[int], bool]]) -> SuffixIndex:
        records = [(tokens, seeded) for tokens, seeded in records if len(tokens)]
        if not records:
            return self
        offset = len(self.tokens)
        parts, starts, at = [], [], offset
        for tokens, _ in records:
            parts += [np.asarray(tokens, dtype=np.uint64), np.array([SEP], dtype=np.uint64)]
            starts.append(at)
            at += len(tokens) + 1
        new = np.concatenate(parts)
        keys, follows = [], []
        for rung, old_keys, old_follows in zip(RUNGS, self.keys, self.follows):
            hashes, ends = _windows(np.concatenate([self.tokens[-1:], new]), rung)
            order = np.argsort(hashes, kind="stable")
            hashes, ends = hashes[order], ends[order] + offset - 1
            # new positions are later than every old one: inserted after equal keys, so each
            # key's positions stay in order and the most recent are last
            where = np.searchsorted(old_keys, hashes, side="right")
            keys.append(np.insert(old_keys, where, hashes))
            follows.append(np.insert(old_follows, where, ends))
        return SuffixIndex(np.concatenate([self.tokens, new]),
                           np.concatenate([self.record_starts, np.array(starts, np.int64)]),
                           np.concatenate([self.seeded, [s for _, s in records]]),
                           tuple(keys), tuple(follows))

    def match(self, context: Sequence[int], min_length: int) -> Match | None:
        """The longest suffix of context found here (at least min_length and the shortest
        rung long), or None."""
        tail = np.asarray(context[-MAX_MATCH:], dtype=np.uint64)
        for rung, keys, follows in reversed(tuple(zip(RUNGS, self.keys, self.follows))):
            if len(tail) < max(rung, min_length):
                continue
            key = _hash(tail[-rung:])
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            if hi == lo:
                continue
            starts = follows[max(lo, hi - MAX_HITS):hi]
            lengths = _match_lengths(self.tokens, starts, tail)
            best = int(lengths.max())
            if best < max(rung, min_length):  # a hash collision, not a match
                continue
            starts = starts[lengths == best]
            record = np.searchsorted(self.record_starts, starts[-1], "right") - 1
            return Match(best, self.tokens, starts, SEEDED if self.seeded[record] else HISTORY)
        return None


def request_match(context: Sequence[int], min_length: int) -> Match | None:
    """The longest suffix of the context that occurred earlier in it, or None."""
    tokens = np.asarray(context, dtype=np.uint64)
    if len(tokens) < 2:
        return None
    ends = np.flatnonzero(tokens[:-1] == tokens[-1]) + 1  # after each earlier last token
    if not len(ends):
        return None
    ends = ends[-MAX_HITS:]
    lengths = _match_lengths(tokens, ends, tokens[-MAX_MATCH:])
    best = int(lengths.max())
    if best < min_length:
        return None
    return Match(best, tokens, ends[lengths == best], REQUEST)


def _windows(tokens: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of the windows of n tokens with no SEP inside and a token after them, and the
    position after each."""
    if len(tokens) <= n:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    hashes = np.zeros(len(tokens) - n, dtype=np.uint64)
    with np.errstate(over="ignore"):  # the hash is arithmetic mod 2**64
        for j in range(n):
            hashes = hashes * _BASE + tokens[j:len(tokens) - n + j]
    is_sep = (tokens == SEP).astype(np.int64)
    seps = np.concatenate([[0], np.cumsum(is_sep)])
    ends = np.arange(n, len(tokens))
    clean = (seps[ends] - seps[ends - n] == 0) & (tokens[ends] != SEP)
    return hashes[clean], ends[clean]


def _hash(window: np.ndarray) -> np.uint64:
    value = np.uint64(0)
    with np.errstate(over="ignore"):
        for token in window:
            value = value * _BASE + token
    return value


def _match_lengths(tokens: np.ndarray, ends: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """Per end, how many tokens before it equal the tail's last ones (at most len(tail))."""
    back = np.arange(1, len(tail) + 1)
    at = ends[:, None] - back[None, :]
    before = np.where(at >= 0, tokens[np.maximum(at, 0)], SEP)
    same = before == tail[::-1][None, :]
    # the first mismatch ends the match; a row of all matches is the whole tail
    return np.where(same.all(axis=1), len(tail), np.argmin(same, axis=1))


def continuations(match: Match, depth: int, tree: bool, max_nodes: int = TREE_NODES,
                  min_prob: float = MIN_TOKEN_PROB) -> tuple[Draft, float]:
    """The draft a match gives, at most depth deep, and its score (the sum of its nodes'
    estimated probabilities: SuffixDecoding prefers the higher score between matches). Its
    survival holds those probabilities, per node: how often the node's path followed the
    match, uncalibrated."""
    if depth <= 0:
        return Draft(), 0.0
    at = match.starts[:, None] + np.arange(depth)[None, :]
    table = np.where(at < len(match.tokens), match.tokens[np.minimum(at, len(match.tokens) - 1)],
                     SEP)
    # a continuation ends at its record's end: nothing after a SEP counts
    table = np.where(np.cumsum(table == SEP, axis=1) > 0, SEP, table)
    rows = np.arange(len(table))
    return _tree(table, rows, depth, max_nodes, min_prob) if tree else \
        _chain(table, rows, depth, min_prob)


def _chain(table: np.ndarray, rows: np.ndarray, depth: int, min_prob: float
           ) -> tuple[Draft, float]:
    """The most likely child of each node in turn, while its probability holds."""
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    for level in range(depth):
        kids = _children(table, rows, level, prob, min_prob)
        if not kids:
            break
        prob, token, rows = kids[0]
        tokens.append(token)
        probs.append(prob)
    return Draft(tokens=tuple(tokens), survival=tuple(probs)), sum(probs)


def _tree(table: np.ndarray, rows: np.ndarray, depth: int, max_nodes: int, min_prob: float
          ) -> tuple[Draft, float]:
    """Best first by probability: a parent is never less likely than its child, so parents
    come first, and a node's likeliest child is its first."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    heap: list[tuple[float, int, int, int, int, np.ndarray]] = []
    for prob, token, kid_rows in _children(table, rows, 0, 1.0, min_prob):
        heap.append((-prob, len(heap), -1, 0, token, kid_rows))
    heapq.heapify(heap)
    serial = len(heap)
    while heap and len(tokens) < max_nodes:
        neg, _, parent, level, token, node_rows = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        probs.append(-neg)
        if level + 1 >= depth:
            continue
        for prob, child, kid_rows in _children(table, node_rows, level + 1, -neg, min_prob):
            heapq.heappush(heap, (-prob, serial, node, level + 1, child, kid_rows))
            serial += 1
    return Draft(tokens=tuple(tokens), parents=tuple(parents), survival=tuple(probs)), \
        sum(probs)


def _children(table: np.ndarray, rows: np.ndarray, level: int, prob: float,
              min_prob: float) -> list[tuple[float, int, np.ndarray]]:
    """The tokens that followed these rows at this level with their probability (count over
    the rows', times prob), most likely first, ties to the most recent; below min_prob left
    out."""
    column = table[rows, level]
    live = column != SEP
    if not live.any():
        return []
    values, inverse, counts = np.unique(column[live], return_inverse=True, return_counts=True)
    live_rows = rows[live]
    latest = np.zeros(len(values), dtype=np.int64)
    np.maximum.at(latest, inverse, live_rows)
    out = []
    for i in np.lexsort((-latest, -counts)):
        p = prob * counts[i] / len(rows)
        if p < min_prob:
            break
        out.append((float(p), int(values[i]), live_rows[inverse == i]))
    return out


class HistorySource(Protocol):
    """What the drafter needs of the history: one partition's index, as it is now."""

    def index(self, partition: str) -> SuffixIndex | None: ...


class SuffixDrafter:
    """Drafts from the longest suffix match in this request or in the history's partition.

    history: where past records are indexed (None: the request only); partition: whose
    history (app/store/history.py's partition_of); tree: draft trees (the target takes
    them); min_match: the shortest match that drafts (a chain member ahead of a model needs a
    match worth pre-empting the model for); request: match this request too (a member behind
    prompt lookup leaves the request to it: lookup declines a short continuation so that the
    model drafts, and a request match here would pre-empt the model with that same short one).
    odds: the partitions' MatchOdds, shared by the drafters `bound` makes (None: its own).

    Its drafts carry their survival (MatchOdds calibrating the counts), so under k="auto" it
    is asked for as deep a draft as the match earns and the k controller cuts it where the
    verify stops paying (`prices_depth`): on an exact repeat, asked for the controller's k, it
    drafted 2.3-3.1 tokens a step, every one accepted.
    """

    capture_layers: tuple[int, ...] = ()
    prices_depth = True

    def __init__(self, history: HistorySource | None = None, partition: str = "local", *,
                 tree: bool = True, min_match: int = 1, max_nodes: int = TREE_NODES,
                 max_spec_factor: float = MAX_SPEC_FACTOR,
                 min_token_prob: float = MIN_TOKEN_PROB, name: str = "suffix",
                 request: bool = True, odds: dict[str, MatchOdds] | None = None) -> None:
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1 (got {min_match})")
        self.history, self.partition, self.tree = history, partition, tree
        self.min_match, self.max_nodes = min_match, max_nodes
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.name, self.request = name, request
        self._odds_by_partition = {} if odds is None else odds
        self.odds = self._odds_by_partition.setdefault(partition, MatchOdds())
        self._index: SuffixIndex | None = None
        self._memo: tuple[int, int, Draft] | None = None
        self._pending: Prediction | None = None

    def bound(self, partition: str) -> SuffixDrafter:
        """The same drafter for another partition (its own state; the history shared)."""
        return SuffixDrafter(self.history, partition, tree=self.tree, min_match=self.min_match,
                             max_nodes=self.max_nodes, max_spec_factor=self.max_spec_factor,
                             min_token_prob=self.min_token_prob, name=self.name,
                             request=self.request, odds=self._odds_by_partition)

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: np.random.Generator) -> None:
        # one snapshot of the history per reply: records added meanwhile wait for the next
        self._index = self.history.index(self.partition) if self.history else None
        self._memo = self._pending = None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return self._drafted(context).within(k)

    def accept(self, feed: StepFeed) -> None:
        return None

    def _drafted(self, context: Sequence[int]) -> Draft:
        # a k="auto" step asks twice (has it anything? then k tokens): draft once a step, as
        # deep as the match earns, and cut per ask
        key = (len(context), int(context[-1]) if len(context) else -1)
        if self._memo is not None and self._memo[:2] == key:
            return self._memo[2]
        if self._pending is not None:
            self._pending.settle(context, self.odds, final=True)
        best, self._pending = self._best(context)
        self._memo = (*key, best)
        return best

    def _best(self, context: Sequence[int]) -> tuple[Draft, Prediction | None]:
        """The match whose calibrated draft promises most tokens, and its first chain's
        prediction for the odds."""
        best, score, prediction = Draft(), 0.0, None
        for match in self._matches(context):
            depth = min(MAX_DEPTH, int(match.length * self.max_spec_factor))
            counted, _ = continuations(match, depth, self.tree, self.max_nodes,
                                       self.min_token_prob)
            draft = self._calibrated(counted, match.length, f"{self.name}:{match.origin}")
            if sum(draft.survival) > score:
                best, score = draft, sum(draft.survival)
                chain = counted.first_chain()
                prediction = Prediction(len(context), chain.tokens, match.length,
                                        _conditional(chain.survival))
        return best, prediction

    def _calibrated(self, counted: Draft, length: int, source: str) -> Draft:
        """The draft with its counts' probabilities turned into survival by the odds: node
        j deep continues a match of length + j - 1 tokens."""
        survival: list[float] = []
        for i, (parent, depth) in enumerate(zip(counted.parent_list(), counted.depths())):
            above = counted.survival[parent] if parent >= 0 else 1.0
            alive = survival[parent] if parent >= 0 else 1.0
            scale = self.odds.scale(length + depth - 1)
            survival.append(alive * min(1.0, scale * counted.survival[i] / above))
        return replace(counted, survival=tuple(survival), source=source)

    def _matches(self, context: Sequence[int]) -> list[Match]:
        found = [request_match(context, self.min_match)] if self.request else []
        if self._index is not None:
            found.append(self._index.match(context, self.min_match))
        return [m for m in found if m is not None]


def _conditional(probs: Sequence[float]) -> tuple[float, ...]:
    """A chain's cumulative probabilities as each node's given the ones before it."""
    return tuple(p / above for p, above in zip(probs, (1.0, *probs)))


def index_of(records: Sequence[Any]) -> SuffixIndex:
    """An index over history records (anything with `tokens` and `kind`)."""
    return SuffixIndex.build([(r.tokens, r.kind == SEEDED) for r in records])


def for_partition(drafter: Any, partition: str) -> Any:
    """The drafter drafting from another partition's history: its suffix members (a chain's
    too) bound to it, every other member itself (a draft model keeps its state)."""
    bound = getattr(drafter, "bound", None)
    if bound is not None:
        return bound(partition)
    members = getattr(drafter, "members", None)
    if not members:
        return drafter
    from app.drafters.chain import ChainDrafter

    return ChainDrafter(tuple(for_partition(m, partition) for m in members), name=drafter.name)
