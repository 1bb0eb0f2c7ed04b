"""The order drafters are tried in, read off app/drafters/kinds.py's records (each kind's
rank, source, reason and verify-state captures), and the sets the planner asks about.

Knows: kinds' records. Must not know: the catalogue, memory or whether a kind runs here
(app/drafters/kinds.py's check says).
"""

from __future__ import annotations

from app.drafters.kinds import DRAFT, FREE, OWN, PER_DRAFTER_LAYER, PREFERENCE, SHIPPED, TABLE

__all__ = ["DRAFT", "FREE", "OWN", "PER_DRAFTER_LAYER", "PREFERENCE", "SHIPPED", "RANKS",
           "HEAD_KINDS", "MODEL_FREE", "NO_KV_CACHE"]

RANKS = {kind.name: kind for kind in PREFERENCE}
HEAD_KINDS = tuple(k.name for k in PREFERENCE if k.source == SHIPPED)  # shipped for one target
MODEL_FREE = frozenset(k.name for k in PREFERENCE if k.source == FREE)
# kinds whose drafter keeps no KV cache of its own, ranked or not (a pair may ship an unranked
# kind: Gemma 4's assistant)
NO_KV_CACHE = frozenset(k.name for k in TABLE if not k.kv_cache)
