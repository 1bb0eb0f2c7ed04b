"""One record per drafter kind, and the one check of a kind against a backend.

Knows: every drafter kind specdeck names, and for each what it needs (nothing, a draft model,
a head folder, the target's own layers), what it asks of a backend's target (rewind, hidden
states, tree attention), whether prompt lookup goes first, whether it drafts trees, whether it
downloads a model of its own, and its description; and `check`: can a kind run here (against
what a backend declares it runs, app/core/protocols.py's `Runs`), and if not, why and what
the fix is. The factory, every surface, the planner and the backends ask `check`, so a
refusal reads the same everywhere; `fallback`: what --drafter auto runs instead.
Must not know: how a drafter is built (the factory and the backends build them), array
libraries, surfaces (each passes what it has at hand: a loaded draft model, a head, a target's
capabilities).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.core.protocols import Capabilities, Runs
from app.core.types import SpecdeckError

# what a kind needs beside the target
NOTHING, DRAFT_MODEL, HEAD, OWN_LAYERS = "nothing", "a draft model", "a head folder", \
    "the target's own layers"
# whether a kind drafts trees: never, always (verified as chains where trees are not), or
# when asked (--tree, "eagle3:tree")
NEVER, ALWAYS, ASKED = "never", "always", "asked"
LOOKUP_FIRST = "lookup+"  # "lookup+eagle3": prompt lookup first, the head where it has nothing
TREE_SUFFIX = ":tree"  # "eagle3:tree": the kind drafting trees (kinds that draft them when asked)
REFERENCE = "torch"  # the backend that builds every kind (a test holds it to that)
# where a kind's drafter comes from, for the planner: the target's own weights, a model trained
# for the target (a head or block drafter the catalogue ships), a smaller model of its family,
# or nothing
OWN, SHIPPED, DRAFT, FREE = "own layers", "shipped", "draft model", "no model"
PER_DRAFTER_LAYER = 0  # captures: one target layer per drafter layer (DFlash, DSpark)
FALLBACKS = ("ngram", "none")  # what auto runs, first that runs, where its choice cannot


@dataclass(frozen=True)
class Kind:
    """One drafter kind: what it needs and asks of a backend, and how it drafts.

    rank: its place in the planner's order, best first (0: the planner never picks it on its
    own), with where it comes from (`source`) and why it stands there; captures: the target
    layers whose hidden states each verify row hands the drafter (the verify state); kv_cache:
    whether the drafter keeps a KV cache of its own per token; takes_head: a kind of the
    target's own layers that also takes them from a folder published apart (--draft DIR)."""

    name: str
    needs: str
    description: str
    trees: str = NEVER
    after_lookup: str = ""  # the kind that drafts where prompt lookup has nothing
    downloads: bool = False  # a model of its own to download (a draft model or a head)
    rank: int = 0
    source: str = ""
    why: str = ""
    captures: int = 0
    kv_cache: bool = True
    takes_head: bool = False

    @property
    def built_as(self) -> str:
        """The kind a backend builds for this one (lookup goes first in the app)."""
        return self.after_lookup or self.name

    @property
    def reads_hidden_states(self) -> bool:
        return self.needs in (HEAD, OWN_LAYERS)

    @property
    def speculates(self) -> bool:
        """Drafts at all, so its target must rewind rejected tokens."""
        return self.name != "none"


# every kind, in the order menus list them
TABLE = (
    Kind("none", NOTHING, "plain decoding"),
    Kind("ngram", NOTHING, "prompt lookup (n-gram)", rank=9, source=FREE,
         why="needs no model; drafts only text that repeats", kv_cache=False),
    Kind("ngram-tree", NOTHING, "prompt lookup with branches (a tree)", trees=ALWAYS),
    Kind("draft", DRAFT_MODEL, "a small draft model", downloads=True, rank=7, source=DRAFT,
         why="a separate small model: its own weights and KV cache, no training for the "
         "target"),
    Kind("chain", DRAFT_MODEL, "prompt lookup, then the draft model", after_lookup="draft",
         downloads=True),
    Kind("eagle3", HEAD, "an EAGLE-3 head on the target's hidden states", trees=ASKED,
         downloads=True, rank=4, source=SHIPPED,
         why="a head shipped for the target, reading three of its layers", captures=3),
    Kind("eagle", HEAD, "an EAGLE-1/2 head on the target's last hidden state", trees=ASKED,
         downloads=True, rank=5, source=SHIPPED,
         why="a head shipped for the target, reading its last layer", captures=1),
    Kind("lookup+eagle3", HEAD, "prompt lookup, then the EAGLE-3 head", trees=ASKED,
         after_lookup="eagle3", downloads=True),
    Kind("lookup+eagle", HEAD, "prompt lookup, then the EAGLE-1/2 head", trees=ASKED,
         after_lookup="eagle", downloads=True),
    # a Qwen3.5 / 3.6 MTP layer published apart (--draft DIR) stands in for the target's own
    Kind("mtp", OWN_LAYERS, "the target's own MTP layers (native multi-token prediction)",
         rank=1, source=OWN,
         why="trained with the target and inside its weights: nothing to download", captures=1,
         takes_head=True),
    Kind("medusa", HEAD, "Medusa heads on the target's last hidden state (a static tree)",
         trees=ALWAYS, downloads=True, rank=6, source=SHIPPED,
         why="heads shipped for the target; each guesses one position on its own", captures=1,
         kv_cache=False),
    Kind("dflash", HEAD, "a DFlash (or DFlash 2) block drafter on the target's hidden states",
         downloads=True, rank=3, source=SHIPPED,
         why="a block drafter shipped for the target: one forward drafts a whole block",
         captures=PER_DRAFTER_LAYER),
    Kind("dspark", HEAD, "a DSpark block drafter (Markov and confidence heads) on the target's "
         "hidden states", downloads=True, rank=2, source=SHIPPED,
         why="a block drafter shipped for the target: one forward drafts a block, and its "
         "confidence head says where to cut it", captures=PER_DRAFTER_LAYER),
    # the planner never picks it on its own (rank 0: nothing measured ranks it yet), though
    # catalogue pairs ship it; a given folder is recognised from its config (app/pair.py's
    # folder_head_kind). Every assistant layer reads the target's keys and values
    # (num_kv_shared_layers is all of them): no KV cache of its own
    Kind("assistant", HEAD, "Gemma 4's assistant: a small drafter reading the target's keys "
         "and values (gemma4_assistant)", downloads=True, captures=3, kv_cache=False),
    Kind("lookahead", NOTHING, "lookahead decoding (Jacobi window and n-gram pool, a tree)",
         trees=ALWAYS, rank=8, source=FREE, why="its tree costs many verify rows per step",
         kv_cache=False),
    # the planner's "ngram" runs as this while history is on (app/loading.py): rank 0
    Kind("suffix", NOTHING, "suffix cache: the longest match in this request or in past "
         "replies (a tree where the target takes trees)", kv_cache=False),
)
BY_NAME = {kind.name: kind for kind in TABLE}
NAMES = tuple(BY_NAME)
# the order the planner tries kinds in, best first
PREFERENCE = tuple(sorted((k for k in TABLE if k.rank), key=lambda k: k.rank))
# the kinds the menus offer as "<kind>:tree": lookup-first kinds are left out, as before
TREE_MENU = tuple(k.name for k in TABLE if k.trees == ASKED and not k.after_lookup)


@dataclass(frozen=True)
class Refusal:
    """Why a kind cannot run here, and the fix; `message` is what every surface shows."""

    kind: str
    reason: str
    fix: str

    @property
    def message(self) -> str:
        return f"{self.reason}: {self.fix}"

    def __str__(self) -> str:
        return self.message


def split(kind: str) -> tuple[str, bool]:
    """("eagle3", True) for "eagle3:tree": the kind and whether its trees were asked for."""
    base = kind.removesuffix(TREE_SUFFIX)
    return base, base != kind


def check(kind: str, runs: Runs | None = None, *, capabilities: Capabilities | None = None,
          tree: bool = False, has_draft: bool | None = None, has_head: bool | None = None,
          head_kind: str | None = None, mtp_layers: int | None = None,
          target: str = "this target") -> Refusal | None:
    """Why kind (a "<kind>:tree" too) cannot run here, or None when it can.

    runs: the backend's declaration (None: no backend in question); capabilities: a loaded
    target's, else the backend's declared ones. has_draft, has_head, head_kind, mtp_layers:
    what is at hand; None leaves that need unchecked (the caller does not know yet). tree:
    --tree was given (kinds that draft trees only when asked heed it; the others ignore it)."""
    base, suffixed = split(kind)
    record = BY_NAME.get(base)
    if record is None:
        return unknown(kind)
    if suffixed and record.trees != ASKED:
        return Refusal(kind, f"drafter {kind!r} does not draft trees",
                       f"pick one of {', '.join(k + TREE_SUFFIX for k in TREE_MENU)}")
    # --tree (tree=True) asks the kinds that draft trees when asked; the others ignore it
    tree = (tree or suffixed) and record.trees == ASKED
    capabilities = capabilities or (runs.capabilities if runs else None)
    # what the backend lacks first: no draft model or head makes it run there
    return (_rewinds(kind, record, capabilities, target)
            or _backend(kind, record, runs, capabilities, tree, target)
            or _inputs(kind, record, has_draft, has_head, head_kind, mtp_layers, target))


def unknown(kind: str) -> Refusal:
    return Refusal(kind, f"unknown drafter {kind!r}", f"use one of {', '.join(NAMES)}")


def chains_only(kind: str, runs: Runs, capabilities: Capabilities | None = None) -> str:
    """Why a kind that always drafts trees pays less here, or '': the engine verifies only a
    tree's first chain where the target has no tree attention (it runs, and the planner
    passes it over)."""
    record = BY_NAME[split(kind)[0]]
    if record.trees != ALWAYS or (capabilities or runs.capabilities).tree_attention:
        return ""
    reason = capabilities.reason if capabilities is not None and capabilities.reason else ""
    why = f" ({reason})" if reason else ""
    return f"{runs.backend} verifies chains only{why}: {record.name}'s tree would shrink to " \
           "its first chain"


def require(kind: str, runs: Runs | None = None, **at_hand: Any) -> None:
    """`check`, raising its message as a SpecdeckError where kind cannot run here."""
    refusal = check(kind, runs, **at_hand)
    if refusal is not None:
        raise SpecdeckError(refusal.message)


def require_built(kind: str, runs: Runs, **at_hand: Any) -> None:
    """`require` for a backend's make_drafter: kind must also be one its own code builds (the
    factory builds the kinds that need nothing, and puts lookup first)."""
    require(kind, runs, **at_hand)
    if kind not in runs.builds:
        raise SpecdeckError(f"the {runs.backend} backend builds {', '.join(sorted(runs.builds))}"
                            f", not {kind!r}: app.drafters.build_drafter builds every kind")


def fallback(kind: str, runs: Runs | None, capabilities: Capabilities | None,
             target: str = "this target") -> tuple[str, Refusal | None]:
    """--drafter auto's last word on a loaded target: (kind, None) when kind runs there, else
    the first of FALLBACKS that does and kind's refusal, so auto is never an error. A kind
    that always drafts trees falls back too where the target verifies chains only."""
    refusal = check(kind, runs, capabilities=capabilities, target=target)
    shrinks = chains_only(kind, runs, capabilities) if runs and refusal is None else ""
    if shrinks:  # it would run, as its tree's first chain: lookup drafts that chain better
        refusal = Refusal(kind, shrinks, "")
    if refusal is None:
        return kind, None
    runnable = [k for k in FALLBACKS
                if check(k, runs, capabilities=capabilities, target=target) is None]
    return (runnable or ["none"])[0], refusal


def _rewinds(kind: str, record: Kind, capabilities: Capabilities | None,
             target: str) -> Refusal | None:
    # a rejected draft would stay in a recurrent state: refuse rather than decode wrongly
    if record.speculates and capabilities is not None and not capabilities.rewind:
        return Refusal(kind, f"{target} cannot speculate: {capabilities.reason}",
                       "use --drafter none")
    return None


def _inputs(kind: str, record: Kind, has_draft: bool | None, has_head: bool | None,
            head_kind: str | None, mtp_layers: int | None, target: str) -> Refusal | None:
    if record.needs == DRAFT_MODEL and has_draft is False:
        return Refusal(kind, f"drafter {kind!r} needs a draft model",
                       "give --draft PATH (a small model of the target's family), or load a "
                       "pair that ships one")
    if record.needs == HEAD and has_head is False:
        return Refusal(kind, f"drafter {kind!r} needs its head",
                       "give --draft HEAD_DIR (the folder with the head's config.json and "
                       "safetensors), or load a pair that ships one")
    own = record.built_as
    if record.needs == HEAD and head_kind not in (None, own):
        return Refusal(kind, f"drafter {kind!r} needs a {own} head, and this pair's head is "
                             f"{head_kind}", f"pick {head_kind}")
    if record.takes_head and head_kind not in (None, record.name):
        return Refusal(kind, f"drafter {kind!r} takes an MTP folder, and this pair's head is "
                             f"{head_kind}", f"pick {head_kind}")
    if record.needs == OWN_LAYERS and mtp_layers == 0 and not (record.takes_head and has_head):
        return Refusal(kind, f"drafter {kind!r} needs MTP layers in the target's own "
                             f"checkpoint, and {target} has none",
                       "give --draft MTP_DIR (its MTP layer published apart), or pick another "
                       "drafter")
    return None


def _backend(kind: str, record: Kind, runs: Runs | None, capabilities: Capabilities | None,
             tree: bool, target: str) -> Refusal | None:
    name = runs.backend if runs else "this"
    if record.reads_hidden_states and capabilities is not None \
            and not capabilities.hidden_states:
        return Refusal(kind, f"drafter {kind!r} reads the target's hidden states, which the "
                             f"{name} backend does not give", f"use --backend {REFERENCE}")
    if runs is not None and record.needs != NOTHING and record.built_as not in runs.builds:
        return Refusal(kind, f"drafter {kind!r} runs on the {REFERENCE} backend only "
                             f"({name} runs {_heads(runs)})", f"use --backend {REFERENCE}")
    if tree and runs is not None and not runs.head_trees:
        return Refusal(kind, f"the {name} backend's {record.built_as} head drafts chains only "
                             "(EAGLE-2 trees are not drafted there yet)",
                       f"drop --tree to draft {record.name} chains, or use --backend "
                       f"{REFERENCE} for trees")
    if tree and capabilities is not None and not capabilities.tree_attention:
        elsewhere = "" if name == REFERENCE else f", or use --backend {REFERENCE} for trees"
        why = (f"{target} verifies chains only: {capabilities.reason}" if capabilities.reason
               else f"the {name} backend lacks tree attention (it verifies chains)")
        return Refusal(kind, f"drafter {kind!r} drafts trees, and {why}",
                       f"drop --tree to draft {record.name} chains{elsewhere}")
    return None


def _heads(runs: Runs) -> str:
    heads = [k.name for k in TABLE if k.needs == HEAD and k.name in runs.builds]
    if not heads:
        return "no heads"
    listed = heads[0] if len(heads) == 1 else f"{', '.join(heads[:-1])} and {heads[-1]}"
    return f"{listed} heads"
