"""Drafters that need no array library of their own, and the one factory every surface uses.

Knows: how each drafter kind (app/drafters/kinds.py's table) is built: prompt lookup (chain
or tree), the suffix cache and lookahead decoding here, a draft model, heads and the
target's own layers by the backend's `make_drafter`, and lookup going first (the suffix
cache where a history is given: it matches the request too); the kind sets older callers
read, derived from the table. Must not know: array libraries (a backend builds the drafters
it owns), surfaces, whether a kind can run on a backend (kinds.check decides; the factory
asks it).
"""

from __future__ import annotations

from typing import Any

from app.core.protocols import Drafter
from app.core.types import SpecdeckError
from app.drafters.chain import ChainDrafter
from app.drafters.kinds import (
    ASKED,
    BY_NAME,
    DRAFT_MODEL,
    HEAD,
    LOOKUP_FIRST,
    NAMES,
    TREE_MENU,
    TREE_SUFFIX,
    require,
)
from app.drafters.lookahead import LookaheadDrafter
from app.drafters.ngram import NgramDrafter, NoDrafter
from app.drafters.suffix import HistorySource, SuffixDrafter

__all__ = ["LOOKUP_FIRST", "TREE_SUFFIX"]

KINDS = NAMES  # every kind, in the order menus list them
NEEDS_DRAFT_MODEL = frozenset(k.name for k in BY_NAME.values() if k.needs == DRAFT_MODEL)
HEADS = frozenset(k.name for k in BY_NAME.values() if k.needs == HEAD)  # --draft is a folder
# the kinds a head folder is handed to: the heads, and own layers that take them from a folder
TAKES_HEAD = HEADS | frozenset(k.name for k in BY_NAME.values() if k.takes_head)
TREES = TREE_MENU  # kinds that draft trees when asked (--tree, "<kind>:tree")
OWN_MODEL = frozenset(k.name for k in BY_NAME.values() if k.downloads)
CHOICES = ("auto", *KINDS)  # what a user may ask for
# CHOICES with each tree-drafting kind's tree right after it (the UI's drafter menus)
WITH_TREES = tuple(c for k in CHOICES for c in ((k, k + TREE_SUFFIX) if k in TREES else (k,)))
BENCH_DEFAULT = ("auto",)  # what `bench` compares with plain unless told: the planner's choice
# the planner names what a pair ships ("draft": a draft model); the fastest way to run it:
# lookup first, the model where lookup has nothing (HumanEval, Qwen pair in w8a8, k=4, median
# of 10 prompts: the model alone 1.43x plain, lookup first on 3+ matching tokens 1.63x)
RUN_AS = {"draft": "chain"}
CHAIN_LOOKUP_MIN_N = 3
TREE_NODES = 16  # node budget of a lookup tree: verify rows stay within the exact blocks


def describe(kind: str) -> str:
    record = BY_NAME.get(kind)
    return record.description if record else kind


def build_drafter(kind: str, target: Any, *, backend: Any = None, draft: Any = None,
                  vocab_limit: int = 0, head: str | None = None, tree: bool = False,
                  history: HistorySource | None = None) -> Drafter:
    """The drafter of this kind for target; SpecdeckError with kinds.check's message when it
    cannot be.

    head: the folder of a head drafter (kinds in HEADS); tree: draft trees where the kind
    drafts them when asked (EAGLE-2 dynamic trees), verified by the tree verifier; the other
    kinds ignore it, as --tree's help says. history: past replies (app/store/history.py's
    History) for the suffix kind, and for the member ahead of a model (None: --no-history;
    prompt lookup goes first then)."""
    require(kind, getattr(backend, "runs", None),
            capabilities=getattr(target, "capabilities", None), tree=tree,
            has_draft=draft is not None, has_head=bool(head),
            target=getattr(target, "name", "this target"))
    if kind == "suffix":
        return _suffix(target, history)
    if kind in _MODEL_FREE:
        return _MODEL_FREE[kind]()
    record = BY_NAME[kind]
    tree = tree and record.trees == ASKED
    if backend is None:
        raise SpecdeckError(f"drafter {kind!r} is built by a backend, and none was given")
    built = backend.make_drafter(record.built_as, target, draft=draft, head=head, tree=tree,
                                 vocab_limit=vocab_limit)
    if not record.after_lookup:
        return built
    # prompt lookup first (it drafts k tokens after a short match in the request); the history
    # next, where lookup has nothing: in the history replay, the suffix cache in lookup's
    # place drafted less on second turns (38 against 45 tok/s on one code edit). The history
    # member leaves the request to lookup, which declines short continuations for the model
    first = (_chain_lookup(),) if history is None else \
        (_chain_lookup(), _suffix(target, history, min_match=CHAIN_LOOKUP_MIN_N, request=False))
    return ChainDrafter((*first, built))


def _suffix(target: Any, history: HistorySource | None, min_match: int = 1,
            request: bool = True) -> SuffixDrafter:
    # trees where the target verifies them and its rows are cheap (not a CPU: there a 16-row
    # tree cost 2.3x a row, and the history replay ran slower than lookup's chains); elsewhere
    # the greedy chain, not a cut tree
    capabilities = getattr(target, "capabilities", None)
    tree = bool(getattr(capabilities, "tree_attention", False)) and \
        getattr(target, "device", "cpu") != "cpu"
    return SuffixDrafter(history, tree=tree, min_match=min_match, max_nodes=TREE_NODES,
                         request=request)


def _chain_lookup() -> NgramDrafter:
    return NgramDrafter(min_n=CHAIN_LOOKUP_MIN_N, max_n=max(CHAIN_LOOKUP_MIN_N, 8),
                        full_only=True, name="lookup")


# the kinds built here, with no backend: they need nothing beside the target
_MODEL_FREE = {
    "none": NoDrafter,
    "ngram": NgramDrafter,
    "ngram-tree": lambda: NgramDrafter(tree=True, max_nodes=TREE_NODES),
    "lookahead": LookaheadDrafter,
}
