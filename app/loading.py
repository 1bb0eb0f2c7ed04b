"""From command-line style settings to a ready SpecEngine: backend, target, drafter, prompt.

Knows: how --target/--drafter/--draft/--k/--backend/--device/--dtype combine into a LoadSpec
and a kind (app/pair.py opens the pair and builds its drafters), --drafter auto's planner
call, the history flags. Must not know: array libraries (backends do the loading), the step
loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from app import drafters
from app.core.engine import SpecEngine, check_k
from app.core.types import SpecdeckError
from app.drafters.kinds import BY_NAME, fallback, require
from app.pair import LoadSpec, Pair, folder_head_kind
from backends import runs_of


@dataclass(frozen=True)
class Loaded:
    engine: SpecEngine
    drafter_name: str
    backend_name: str
    notes: tuple[str, ...] = ()  # why this drafter (the planner's reasons for --drafter auto)
    draft: Any = None  # the loaded draft model, when the drafter uses one
    backend: Any = None
    history: Any = None  # app/store/history.History, None under --no-history
    rebuild: Any = None  # kind -> a new drafter as this load builds it (a stream slot's own)
    pair: Any = None  # the opened Pair (app/pair.py)


SUFFIX_NOTE = ("drafter: suffix, prompt lookup over this request and past replies "
               "(--no-history: the request only)")


def history_kind(kind: str, history_on: bool, asked: str) -> str:
    """The kind auto runs where history is kept: its model-free lookup becomes the suffix
    cache, which also reads past replies (every surface that names the kind asks here)."""
    return "suffix" if kind == "ngram" and history_on and asked == "auto" else kind


def load_engine(args: Any) -> Loaded:
    """Build the engine the flags describe; every user mistake raises SpecdeckError.

    The way from the flags to the drafter: a LoadSpec, the kind decided (auto: the planner,
    before any loading), Pair.open, Pair.build (its one check of the kind)."""
    check_k(args.k)  # the engine's one rule, before minutes of loading
    if not args.target:
        raise SpecdeckError("give a target model with --target PATH (HF folder or .gguf)")
    spec = LoadSpec.from_flags(args).resolved()
    tree = bool(getattr(args, "tree", False))
    drafter_kind, notes, spec = _kind_before_loading(args, spec, tree)
    pair = Pair.open(replace(spec, draft=None))
    if args.drafter == "auto":
        drafter_kind, notes = _runnable(drafter_kind, notes, pair)
    if spec.draft and drafter_kind in drafters.NEEDS_DRAFT_MODEL:  # auto may have fallen back
        pair.load_draft(spec.draft)
    pair.history = open_history(args, pair.target)
    if history_kind(drafter_kind, pair.history is not None, args.drafter) != drafter_kind:
        drafter_kind = "suffix"
        notes = (*notes, SUFFIX_NOTE)
    if args.k == 0:
        drafter_kind = "none"
    vocab_limit = getattr(args, "draft_vocab", 0)
    drafter = pair.build(drafter_kind, tree=tree, vocab_limit=vocab_limit)
    engine = pair.engine()
    engine.set_default(None if drafter_kind == "none" else drafter, args.k)

    def rebuild(kind: str) -> Any:
        own = kind == drafter_kind  # the loaded kind keeps its trees and vocabulary
        return pair.build(kind, tree=tree and own, vocab_limit=vocab_limit if own else 0)

    return Loaded(engine=engine, drafter_name=drafter_kind, backend_name=pair.backend.name,
                  notes=notes, draft=pair.draft, backend=pair.backend, history=pair.history,
                  rebuild=rebuild, pair=pair)


def _kind_before_loading(args: Any, spec: LoadSpec, tree: bool
                         ) -> tuple[str, tuple[str, ...], LoadSpec]:
    """The kind to run, why, and the spec to open: what it needs checked before minutes of
    loading; auto's choice from the planner; a draft model loaded only for a kind that
    drafts with one, a head folder kept as the head."""
    kind, notes = args.drafter, ()
    if kind != "auto":
        require(kind, runs_of(args.backend), tree=tree, has_draft=bool(spec.draft),
                has_head=bool(spec.draft or spec.head))
    given_head = folder_head_kind(spec.draft)
    # a kind of own layers takes any folder given (the target's original checkpoint, say) as
    # where its layers are: its loader checks the folder
    if given_head or (spec.draft and kind in drafters.TAKES_HEAD - drafters.HEADS):
        spec = replace(spec, draft=None, head=spec.draft)
    if kind != "auto":
        if given_head and kind in drafters.NEEDS_DRAFT_MODEL:
            raise SpecdeckError(f"{spec.head} is {BY_NAME[given_head].description}, not a "
                                f"draft model: use --drafter {given_head}")
    elif given_head:
        kind, notes = given_head, (f"drafter: {given_head}, the head {spec.head} (given)",)
    else:
        given = spec.draft if args.draft else None  # a pair's own draft is the planner's to pick
        choice = Pair.auto(replace(spec, target=args.target), given)
        kind, path, notes = choice.kind, choice.path, choice.reasons
        spec = (replace(spec, draft=None, head=path, head_kind=kind)
                if kind in drafters.HEADS else replace(spec, draft=path))
    speculates = args.k != 0
    return kind, notes, replace(
        spec, draft=spec.draft if speculates and kind in drafters.NEEDS_DRAFT_MODEL else None,
        head=spec.head if speculates and kind in drafters.TAKES_HEAD else None)


def open_history(args: Any, target: Any) -> Any:
    """The target's tokenizer's history under SPECDECK_HOME, None under --no-history."""
    if getattr(args, "no_history", False):
        return None
    from app.store import history
    from app.store.cache_cli import bounds_of

    return history.open_history(target.tokenizer, bounds_of(args))


def _runnable(kind: str, notes: tuple[str, ...], pair: Pair) -> tuple[str, tuple[str, ...]]:
    """auto's kind where it runs on the opened target, else its fallback; the first note (the
    line surfaces show for auto) then says why. Asked before the draft model loads (minutes,
    for a kind that may not run): what is at hand is the backend and the target, not the
    draft, so this is kinds.fallback on them, not the loaded pair's Pair.fallback."""
    chosen, refusal = fallback(kind, pair.backend.runs, pair.target.capabilities,
                               pair.target.name)
    if refusal is None:
        return kind, notes
    return chosen, (f"drafter: {chosen} (not {kind}: {refusal.reason})", *notes[1:])
