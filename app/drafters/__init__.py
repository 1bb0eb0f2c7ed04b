"""Drafters that need no array library of their own, and the one factory every surface uses.

Knows: every drafter kind specdeck names (the catalogue's, the CLI's, the server's, the UI's),
which of them can be built, and how: prompt lookup (chain or tree), lookahead decoding, the
draft model through the backend, and their chain. Must not know: array libraries (a backend
builds the model drafters it owns), surfaces.
"""

from __future__ import annotations

from typing import Any

from app.core.protocols import Drafter
from app.core.types import SpecdeckError
from app.drafters.chain import ChainDrafter
from app.drafters.lookahead import LookaheadDrafter
from app.drafters.ngram import NgramDrafter, NoDrafter

# every kind, in the order menus list them; heads come with their issues
KINDS = ("none", "ngram", "ngram-tree", "draft", "chain",
         "eagle3", "eagle", "lookup+eagle3", "lookup+eagle", "mtp", "medusa", "dflash",
         "lookahead")
IMPLEMENTED = frozenset({"none", "ngram", "ngram-tree", "draft", "chain", "lookahead",
                         "medusa", "mtp", "dflash", "eagle3", "eagle", "lookup+eagle3",
                         "lookup+eagle"})
NEEDS_DRAFT_MODEL = frozenset({"draft", "chain"})
# drafters whose --draft is a head folder, not a model
HEADS = frozenset({"medusa", "dflash", "eagle3", "eagle", "lookup+eagle3", "lookup+eagle"})
TREES = frozenset({"eagle3", "eagle"})  # kinds that draft trees when asked (--tree)
TORCH_ONLY = frozenset({"mtp", "medusa", "dflash"})  # kinds the MLX backend does not run
NATIVE = frozenset({"mtp"})  # kinds that draft with layers inside the target's own checkpoint
# kinds that read the target's hidden states (a logits-only target cannot feed them)
READS_HIDDEN_STATES = HEADS | NATIVE
# what a target that returns logits only runs (no hidden states for heads, no tree attention:
# the llama.cpp backend)
LOGITS_ONLY = frozenset({"none", "ngram", "draft", "chain"})
OWN_MODEL = frozenset({"draft", "chain", "eagle3", "eagle", "dflash", "medusa", "lookup+eagle3",
                       "lookup+eagle"})  # downloads
# "lookup+eagle3": prompt lookup first, the head where lookup has nothing (as "chain" does for
# the draft model); the head still reads every verify forward, so it drafts from the right state
LOOKUP_FIRST = "lookup+"
CHOICES = ("auto", *(k for k in KINDS if k in IMPLEMENTED))  # what a user may ask for
TREE_SUFFIX = ":tree"  # "eagle3:tree": the kind drafting trees (kinds in TREES)
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
    return {"none": "plain decoding", "ngram": "prompt lookup (n-gram)",
            "ngram-tree": "prompt lookup with branches (a tree)",
            "draft": "a small draft model", "chain": "prompt lookup, then the draft model",
            "lookahead": "lookahead decoding (Jacobi window and n-gram pool, a tree)",
            "medusa": "Medusa heads on the target's last hidden state (a static tree)",
            "mtp": "the target's own MTP layers (native multi-token prediction)",
            "dflash": "a DFlash block drafter on the target's hidden states",
            "eagle3": "an EAGLE-3 head on the target's hidden states",
            "eagle": "an EAGLE-1/2 head on the target's last hidden state",
            "lookup+eagle3": "prompt lookup, then the EAGLE-3 head",
            "lookup+eagle": "prompt lookup, then the EAGLE-1/2 head",
            }.get(kind, kind)


def build_drafter(kind: str, target: Any, *, backend: Any = None, draft: Any = None,
                  vocab_limit: int = 0, head: str | None = None, tree: bool = False) -> Drafter:
    """The drafter of this kind for target; SpecdeckError naming the fix when it cannot be.

    head: the folder of a head drafter (kinds in HEADS); tree: draft trees where the kind can
    (TREES: EAGLE-2 dynamic trees), verified by the tree verifier."""
    if kind not in KINDS:
        raise SpecdeckError(f"unknown drafter {kind!r}: use one of {', '.join(CHOICES)}")
    if kind not in IMPLEMENTED:
        raise SpecdeckError(f"drafter {kind!r} is not built into specdeck yet: use one of "
                            f"{', '.join(CHOICES)}")
    if kind == "none":
        return NoDrafter()
    capabilities = getattr(target, "capabilities", None)
    if capabilities is not None and not capabilities.rewind:
        # a rejected draft would stay in a recurrent state: refuse rather than decode wrongly
        raise SpecdeckError(f"{getattr(target, 'name', 'this target')} cannot speculate: "
                            f"{capabilities.reason}; use --drafter none")
    if kind == "ngram":
        return NgramDrafter()
    if kind == "ngram-tree":
        return NgramDrafter(tree=True, max_nodes=TREE_NODES)
    if kind == "lookahead":
        return LookaheadDrafter()
    if kind in HEADS:
        return _head_drafter(kind, target, backend, head, tree)
    if kind == "mtp":
        if backend is None or not hasattr(backend, "mtp_drafter"):
            name = getattr(backend, "name", "this backend")
            raise SpecdeckError(f"drafter 'mtp' is not on {name} yet: use --backend torch")
        return backend.mtp_drafter(target)
    if draft is None or backend is None:
        raise SpecdeckError(f"drafter {kind!r} needs a draft model: give --draft PATH (a small "
                            "model of the target's family) or pull a pair that has one")
    model = backend.draft_model_drafter(target, draft, vocab_limit=vocab_limit)
    if kind == "draft":
        return model
    return ChainDrafter((_chain_lookup(), model))


def _chain_lookup() -> NgramDrafter:
    return NgramDrafter(min_n=CHAIN_LOOKUP_MIN_N, max_n=max(CHAIN_LOOKUP_MIN_N, 8),
                        full_only=True, name="lookup")


def _head_drafter(kind: str, target: Any, backend: Any, head: str | None, tree: bool
                  ) -> Drafter:
    if kind.startswith(LOOKUP_FIRST):
        inner = _head_drafter(kind.removeprefix(LOOKUP_FIRST), target, backend, head, tree)
        return ChainDrafter((_chain_lookup(), inner))
    if not head:
        raise SpecdeckError(f"drafter {kind!r} needs its head: give --draft HEAD_DIR (the folder "
                            "with the head's config.json and safetensors)")
    if backend is None or not hasattr(backend, "head_drafter"):
        name = getattr(backend, "name", "this backend")
        raise SpecdeckError(f"drafter {kind!r} is not on {name} yet: use --backend torch")
    return backend.head_drafter(kind, target, head, tree=tree)
