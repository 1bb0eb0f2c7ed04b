"""Values that flow through specdeck: sampling settings, drafts, verdicts, events, metrics.

Knows: the domain words (target, drafter, draft tokens, accepted, recovered, bonus, step, k)
and the field's metric definitions. Must not know: any array library or backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

StopReason = Literal["eos", "length", "stop_string", "cancelled", "error"]


class SpecdeckError(Exception):
    """An error a user can fix; the message names the fix. Never shown as a traceback."""


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables the filter
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy"),
            (self.top_k >= 0, f"top_k must be >= 0 (got {self.top_k}); use 0 to disable it"),
            (0 < self.top_p <= 1,
             f"top_p must be in (0, 1] (got {self.top_p}); use 1 to disable it"),
            (0 <= self.min_p < 1,
             f"min_p must be in [0, 1) (got {self.min_p}); use 0 to disable it"),
            (self.max_new_tokens >= 1,
             f"max_new_tokens must be >= 1 (got {self.max_new_tokens})"),
        ]
        for ok, message in checks:
            if not ok:
                raise SpecdeckError(message)
        if any(not s for s in self.stop):
            raise SpecdeckError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Draft:
    """Draft tokens: a chain (parents None) or a tree whose nodes follow their parents.

    parents[i] is the index of node i's parent, -1 for a child of the pending token; nodes
    come after their parents (parents[i] < i), so any prefix of the nodes is a tree too. A
    chain is the tree with parents -1, 0, 1, ...
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] | None = None
    # numpy [n_nodes, draft_vocab] float: the q node i was drawn from, given its earlier
    # siblings (sampling without replacement renormalises q without them); None = one-hot
    probs: Any = None
    source: str = ""  # the drafter (a chain's member) that proposed these tokens
    # seconds of the propose spent reading context the drafter had not seen (after steps
    # without drafting or drafted by another chain member): the k controller charges it to
    # an exploration's check of whether drafting paid, never to its per-step estimates
    catch_up_s: float = 0.0
    catch_up_rows: int = 0  # the context rows that catch-up read
    # the catch-up was this reply's prompt, read on first drafting: paid once a reply however
    # drafting goes, so not charged to that check either
    reads_prompt: bool = False
    # per node, the drafter's own estimate that it and every node before it are accepted
    # (DSpark's confidence head); empty where the drafter has none
    survival: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.parents is not None and (
                len(self.parents) != len(self.tokens)
                or any(not -1 <= p < i for i, p in enumerate(self.parents))):
            raise ValueError(f"tree parents must precede their nodes: {self.parents}")

    @property
    def is_tree(self) -> bool:
        """True when some node has a sibling (a chain written with parents is no tree)."""
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def parent_list(self) -> tuple[int, ...]:
        return self.parents if self.parents is not None else tuple(range(-1, len(self.tokens) - 1))

    def depths(self) -> tuple[int, ...]:
        """depth[i]: 1 for a child of the pending token, 2 for its child, ..."""
        depth: list[int] = []
        for p in self.parent_list():
            depth.append(1 if p < 0 else depth[p] + 1)
        return tuple(depth)

    def row_parents(self) -> tuple[int, ...]:
        """Parents of the verify rows [pending, *tokens]: -1 (the cache) for the pending row."""
        return (-1, *(p + 1 for p in self.parent_list()))

    def within(self, max_depth: int) -> Draft:
        """The nodes at depth <= max_depth (a chain: its first max_depth tokens)."""
        if self.parents is None:  # a chain's depths are its positions: no walk needed
            keep = list(range(min(len(self.tokens), max_depth)))
        else:
            keep = [i for i, d in enumerate(self.depths()) if d <= max_depth]
        if len(keep) == len(self.tokens):
            return self
        return self._subset(keep)

    def first_chain(self) -> Draft:
        """The path through every node's first child: what a verifier without trees checks."""
        keep, at = [], -1
        for i, p in enumerate(self.parent_list()):
            if p == at:
                keep.append(i)
                at = i
        return replace(self._subset(keep), parents=None)

    def _subset(self, keep: list[int]) -> Draft:
        index = {old: new for new, old in enumerate(keep)}
        parents = self.parent_list()
        probs = None if self.probs is None else self.probs[keep]
        new_parents = tuple(index[parents[i]] if parents[i] >= 0 else -1 for i in keep)
        survival = tuple(self.survival[i] for i in keep) if self.survival else ()
        return replace(self, tokens=tuple(self.tokens[i] for i in keep), probs=probs,
                       parents=None if self.parents is None else new_parents,
                       survival=survival)


def tree_parents(parents: Sequence[int] | None, n: int) -> tuple[int, ...] | None:
    """A forward's `parents` (Session.forward) as a tuple when they describe a tree of n rows,
    None for a chain or none given; ValueError where a row does not follow its parent."""
    if parents is None:
        return None
    parents = tuple(int(p) for p in parents)
    if len(parents) != n or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"parents must precede their rows: {parents}")
    return None if parents == tuple(range(-1, n - 1)) else parents


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: the accepted path and the token after it.

    path: accepted node indices, root to leaf (a chain: 0 .. m-1). next_token: the recovered
    token on a rejection, the bonus token when the path ends at a leaf.
    """

    path: tuple[int, ...]
    next_token: int
    is_bonus: bool

    @property
    def n_accepted(self) -> int:
        return len(self.path)


@dataclass(frozen=True)
class DrafterStats:
    """One drafter's share of a generation (a chain's members each have their own)."""

    name: str
    steps: int = 0  # verify steps whose draft this drafter proposed
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self, target_forwards: int) -> dict[str, Any]:
        # its accepted tokens per target forward: τ = 1 + the members' contributions
        tau = self.accepted / target_forwards if target_forwards else 0.0
        return {"name": self.name, "steps": self.steps, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "tau_contribution": tau}


@dataclass(frozen=True)
class RunStats:
    """Metrics of one generation, with the field's definitions (see ARCHITECTURE.md)."""

    n_prompt_tokens: int = 0
    n_cached_prompt_tokens: int = 0  # prompt tokens reused from the session's cache
    n_new_tokens: int = 0
    target_forwards: int = 0  # verify forwards after the prefill
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()  # accepted[j]: steps whose draft j survived
    drafted_per_position: tuple[int, ...] = ()  # steps that proposed a draft at position j
    accepted_length_histogram: tuple[int, ...] = ()  # [m]: steps that accepted m drafts
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    speculation_off_steps: int = 0  # steps where k="auto" chose not to draft (it did not pay)
    # of those, steps where it would have paid alone: the other streams filled the forward
    load_off_steps: int = 0
    streams: int = 1  # live streams in the step's forward (batched streams), at the last step
    peak_memory_bytes: int = 0
    drafters: tuple[DrafterStats, ...] = ()  # per drafter that proposed, in order of first use

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens committed per target forward, bonus included; plain decoding is 1.0."""
        decoded = self.n_new_tokens - 1  # the first token comes from the prefill forward
        return decoded / self.target_forwards if self.target_forwards else 1.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first token, prefill excluded."""
        decoded = self.n_new_tokens - 1
        return decoded / self.decode_s if self.decode_s > 0 and decoded > 0 else 0.0

    @property
    def other_s(self) -> float:
        """Decode time spent outside drafting and verification (sampling, stop rules, text)."""
        return max(self.decode_s - self.draft_s - self.verify_s, 0.0)

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        """Share of steps that reached position j and accepted it."""
        return tuple(a / d if d else 0.0
                     for a, d in zip(self.accepted_per_position, self.drafted_per_position))

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready view; the names are a contract read by CLI, server and bench."""
        return {
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_cached_prompt_tokens": self.n_cached_prompt_tokens,
            "n_new_tokens": self.n_new_tokens,
            "target_forwards": self.target_forwards,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "acceptance_per_position": list(self.acceptance_per_position),
            "accepted_length_histogram": list(self.accepted_length_histogram),
            "decode_tok_s": self.decode_tok_s,
            "ttft_s": self.ttft_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "other_s": self.other_s,
            "speculation_off_steps": self.speculation_off_steps,
            "load_off_steps": self.load_off_steps,
            "streams": self.streams,
            "peak_memory_bytes": self.peak_memory_bytes,
            "drafters": [d.to_dict(self.target_forwards) for d in self.drafters],
        }


@dataclass(frozen=True)
class Step:
    """One engine step as seen by a consumer: the tokens committed and where they came from."""

    tokens: tuple[int, ...]  # committed this step, already cut at a stop rule
    from_draft: tuple[bool, ...]  # True where the token was an accepted draft token
    text: str  # text delta; may be empty while a UTF-8 character is incomplete
    n_drafted: int
    n_accepted: int
    stats: RunStats


@dataclass(frozen=True)
class Done:
    """End of a generation: the full output and final metrics."""

    text: str
    token_ids: tuple[int, ...]
    stop_reason: StopReason
    stats: RunStats
    error: str | None = None
    from_draft: tuple[bool, ...] = field(default=())


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest shared prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
