"""The order drafters are tried in: one Rank a kind, where its drafter comes from (the target's
own layers, a model shipped for it, a draft model, nothing), why it stands there, and what its
verify state captures.

Knows: only kinds' names. Must not know: the catalogue, memory or whether a kind runs here
(app/drafters/kinds.py's check says).
"""

from __future__ import annotations

from dataclasses import dataclass

# where a drafter comes from: the target's own weights, a model trained for the target (a
# head or block drafter the catalogue ships), a smaller model of its family, or nothing
OWN, SHIPPED, DRAFT, FREE = "own layers", "shipped", "draft model", "no model"
PER_DRAFTER_LAYER = 0  # captures: one target layer per drafter layer (DFlash, DSpark)


@dataclass(frozen=True)
class Rank:
    """One place in the order: a kind, where it comes from, and why it stands there.

    captures: the target layers whose hidden states each verify row hands the drafter (the
    verify state); kv_cache: whether the drafter keeps a KV cache of its own per token."""

    kind: str
    source: str
    why: str
    captures: int = 0
    kv_cache: bool = True


# the order drafters are tried in, best first; a new kind is one line here
PREFERENCE = (
    Rank("mtp", OWN, "trained with the target and inside its weights: nothing to download",
         captures=1),
    Rank("dspark", SHIPPED, "a block drafter shipped for the target: one forward drafts a "
         "block, and its confidence head says where to cut it", captures=PER_DRAFTER_LAYER),
    Rank("dflash", SHIPPED, "a block drafter shipped for the target: one forward drafts a "
         "whole block", captures=PER_DRAFTER_LAYER),
    Rank("eagle3", SHIPPED, "a head shipped for the target, reading three of its layers",
         captures=3),
    Rank("eagle", SHIPPED, "a head shipped for the target, reading its last layer", captures=1),
    Rank("medusa", SHIPPED, "heads shipped for the target; each guesses one position on its "
         "own", captures=1, kv_cache=False),
    Rank("draft", DRAFT, "a separate small model: its own weights and KV cache, no training "
         "for the target"),
    Rank("lookahead", FREE, "its tree costs many verify rows per step", kv_cache=False),
    Rank("ngram", FREE, "needs no model; drafts only text that repeats", kv_cache=False),
)
RANKS = {rank.kind: rank for rank in PREFERENCE}
HEAD_KINDS = tuple(r.kind for r in PREFERENCE if r.source == SHIPPED)  # shipped for one target
MODEL_FREE = frozenset(r.kind for r in PREFERENCE if r.source == FREE)
