"""From command-line style settings to a ready SpecEngine: backend, target, drafter, prompt.

Knows: how --target/--drafter/--draft/--k/--backend/--device/--dtype combine, the chat
template. Must not know: array libraries (backends do the loading), the step loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app import drafters
from app.core.engine import SpecEngine
from app.core.types import SpecdeckError
from app.drafters.kinds import fallback, require
from backends import load_backend, runs_of
from backends.extras import files_of


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


SUFFIX_NOTE = ("drafter: suffix, prompt lookup over this request and past replies "
               "(--no-history: the request only)")


def history_kind(kind: str, history_on: bool, asked: str) -> str:
    """The kind auto runs where history is kept: its model-free lookup becomes the suffix
    cache, which also reads past replies (every surface that names the kind asks here)."""
    return "suffix" if kind == "ngram" and history_on and asked == "auto" else kind


def load_engine(args: Any) -> Loaded:
    """Build the engine the flags describe; every user mistake raises SpecdeckError."""
    if args.k != "auto" and args.k < 0:
        raise SpecdeckError(f"--k must be >= 0 or auto (got {args.k})")
    if not args.target:
        raise SpecdeckError("give a target model with --target PATH (HF folder or .gguf)")
    drafter_kind = args.drafter
    pair = _installed_pair(args.target, files_of(args.backend))
    draft_path = args.draft or (str(pair[1]) if pair and pair[1] else None)
    tree = bool(getattr(args, "tree", False))
    if drafter_kind != "auto":  # before any loading: what it needs, what the backend runs
        require(drafter_kind, runs_of(args.backend), tree=tree, has_draft=bool(draft_path),
                has_head=bool(draft_path))
    backend = load_backend(args.backend)
    draft_path = head_folder(draft_path, files_of(backend.name))
    given_head = _head_kind(draft_path)
    if given_head and drafter_kind in drafters.NEEDS_DRAFT_MODEL:
        raise SpecdeckError(f"{draft_path} is an EAGLE head, not a draft model: use --drafter "
                            f"{given_head}")
    target_path = str(pair[0]) if pair else args.target
    _refuse_corrupted_files(target_path, draft_path)
    target = backend.load(target_path, device=args.device, dtype=args.dtype)
    notes: tuple[str, ...] = ()
    if drafter_kind == "auto" and given_head:
        notes = (f"drafter: {given_head}, the head {draft_path} (given)",)
        drafter_kind = given_head
    elif drafter_kind == "auto":
        drafter_kind, draft_path, notes = auto_drafter(args.target, backend.name, args.device,
                                                       args.draft)
    if args.drafter == "auto":
        drafter_kind, notes = _runnable(drafter_kind, notes, backend, target)
    history = open_history(args, target)
    if history_kind(drafter_kind, history is not None, args.drafter) != drafter_kind:
        drafter_kind = "suffix"
        notes = (*notes, SUFFIX_NOTE)
    if args.k == 0:
        drafter_kind = "none"
    draft = None
    if drafter_kind in drafters.NEEDS_DRAFT_MODEL:
        draft_dtype = getattr(args, "draft_dtype", None) or args.dtype
        draft = backend.load(draft_path, device=args.device, dtype=draft_dtype)
    # a head folder is the head drafter's own input, never loaded as a causal LM
    head = draft_path if drafter_kind in drafters.HEADS else None
    drafter = drafters.build_drafter(drafter_kind, target, backend=backend, draft=draft,
                                     vocab_limit=getattr(args, "draft_vocab", 0), head=head,
                                     tree=tree, history=history)
    engine = SpecEngine(target, None if drafter_kind == "none" else drafter, k=args.k,
                        recorder=history)

    def rebuild(kind: str) -> Any:
        own = kind == drafter_kind  # the loaded kind keeps its head, trees and vocabulary
        return drafters.build_drafter(
            kind, target, backend=backend, draft=draft, history=history,
            vocab_limit=getattr(args, "draft_vocab", 0) if own else 0,
            head=head if own else None, tree=tree and own)

    return Loaded(engine=engine, drafter_name=drafter_kind, backend_name=backend.name,
                  notes=notes, draft=draft, backend=backend, history=history,
                  rebuild=rebuild)


def open_history(args: Any, target: Any) -> Any:
    """The target's tokenizer's history under SPECDECK_HOME, None under --no-history."""
    if getattr(args, "no_history", False):
        return None
    from app.store import history
    from app.store.cache_cli import bounds_of

    return history.open_history(target.tokenizer, bounds_of(args))


def _runnable(kind: str, notes: tuple[str, ...], backend: Any, target: Any
              ) -> tuple[str, tuple[str, ...]]:
    """auto's kind where it runs on the loaded target, else its fallback; the first note (the
    line surfaces show for auto) then says why."""
    chosen, refusal = fallback(kind, backend.runs, target.capabilities, target.name)
    if refusal is None:
        return kind, notes
    return chosen, (f"drafter: {chosen} (not {kind}: {refusal.reason})",
                    *notes[1:])


def _installed_pair(target: str, backend: str) -> tuple[Any, Any] | None:
    """(target path, draft path) when --target names a catalogue pair rather than a path."""
    from pathlib import Path

    from app import store
    from app.catalogue import registry

    if Path(target).expanduser().exists() or target not in registry.load_catalogue().pairs:
        return None
    return store.installed_paths(target, None if backend == "auto" else backend,
                                 need_draft=False)


def _head_kind(path: str | None) -> str | None:
    """The EAGLE kind of a head folder (config and safetensors header only), else None."""
    if not path:
        return None
    from backends.heads.eagle_format import head_kind
    return head_kind(path)


def head_folder(path: str | None, backend: str) -> str | None:
    """A head (or model) given as a folder, or as a catalogue model id `specdeck pull`
    installed."""
    from pathlib import Path

    from app import store
    from app.catalogue import registry

    models = registry.load_catalogue().models
    if not path or Path(path).expanduser().exists() or path not in models:
        return path
    found = store.model_path(models[path], backend)
    if found is None:
        pairs = [p.id for p in registry.load_catalogue().pairs.values()
                 if p.drafter is not None and p.drafter.id == path]
        pull = f"`specdeck pull {pairs[0]}`" if pairs else "`specdeck pull`"
        raise SpecdeckError(f"{path} is not downloaded: {pull} fetches it")
    return str(found)


def _refuse_corrupted_files(*paths: str | None) -> None:
    """A pulled model's file given by path is checked like one given by pair id (a pair's
    were checked when its paths were looked up; checking again costs a stat)."""
    from app import store

    for path in paths:
        if path:
            store.check_file(path)


def auto_drafter(target: str, backend: str, device: str, draft_path: str | None
                 ) -> tuple[str, str | None, tuple[str, ...]]:
    """--drafter auto: the --draft model when given, else the planner's choice among the
    drafters that are downloaded (a missing one is named in the notes, never fetched) and
    that the backend runs (kinds.check, as every surface asks). The kind is the one to run
    (a draft model runs as its chain, lookup first)."""
    from app import store
    from app.catalogue import planner

    if draft_path:
        return "chain", draft_path, (f"drafter: lookup, then the draft {draft_path} (given)",)
    files = files_of(backend)  # llama.cpp plans over the GGUF files pulled for torch
    try:
        plan = planner.plan(target, files, device, runs=runs_of(backend),
                            installed=lambda model: store.model_path(model, files))
    except SpecdeckError as error:
        return "ngram", None, (f"drafter: ngram (the planner could not read the target: {error})",)
    path = str(plan.choice.path) if plan.choice.path else None
    return drafters.RUN_AS.get(plan.choice.kind, plan.choice.kind), path, tuple(plan.reasons())
