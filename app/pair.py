"""A pair as every surface opens it: a target, what drafts for it, and the one check of a kind.

The CLI, the server, the UI and bench each make a `LoadSpec` (from flags, a catalogue id or the
page) and open it here; the way from a flag to a built drafter is then spec -> `Pair.open` ->
`Pair.drafter` -> the backend's builder, with no return to the store after open and one kind
check (`Pair.check`) that has every fact filled in.

Knows: how a spec's names resolve (a catalogue pair id to its installed files, a head given as
a catalogue model id to its folder), that pulled files are checked before they load, that a
head folder is the head drafter's input and never loads as a model, the draft model's
vocabulary check, what a loaded pair lends a kind (the backend's declaration, the target's
capabilities, a draft model, the head and its kind, the target's MTP layers), drafters built
once per kind, auto's choice (the planner's, made before open since it decides what loads),
and the target's one engine (its KV cache, probed costs and history recorder), which every
surface generates with, a lane beside it where two generations run at once.
Must not know: flags, Gradio or HTTP (the surfaces make the spec and say the messages), array
libraries (backends load the models), the step loop (app/core/engine.py runs it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app import drafters
from app.core.types import SpecdeckError
from app.drafters.kinds import BY_NAME, FALLBACKS, Refusal, check, fallback, split
from app.drafters.pairing import check_vocab_compatible
from backends import detect_backend, load_backend

Progress = Callable[[str], None]
MAIN = "main"  # the engine's lane every surface generates with


@dataclass(frozen=True)
class LoadSpec:
    """What to open: a target (a path or a catalogue pair id), a draft model or a head folder
    (paths or catalogue model ids), and where and how the models load."""

    target: str
    draft: str | None = None
    head: str | None = None
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    draft_dtype: str | None = None
    head_kind: str | None = None  # the catalogue's word for the head, where it ships one

    @classmethod
    def from_flags(cls, args: Any, **given: Any) -> LoadSpec:
        """The spec of the common flags (--target --draft --backend --device --dtype
        --draft-dtype); `given` overrides any field."""
        fields = {"target": getattr(args, "target", None) or "",
                  "draft": getattr(args, "draft", None),
                  "backend": getattr(args, "backend", "auto"),
                  "device": getattr(args, "device", "auto"),
                  "dtype": getattr(args, "dtype", "auto"),
                  "draft_dtype": getattr(args, "draft_dtype", None)}
        return cls(**{**fields, **given})

    def resolved(self) -> LoadSpec:
        """Catalogue names turned into installed paths: a pair id gives its target (and its
        draft model, unless one is given), a model id its folder; SpecdeckError names the
        `specdeck pull` that fetches what is missing."""
        from backends.extras import files_of

        files = files_of(detect_backend() if self.backend == "auto" else self.backend)
        pair = installed_pair(self.target, files)
        draft = self.draft or (str(pair[1]) if pair and pair[1] else None)
        return replace(self, target=str(pair[0]) if pair else self.target,
                       draft=catalogue_folder(draft, files),
                       head=catalogue_folder(self.head, files))


@dataclass(frozen=True)
class AutoChoice:
    """What --drafter auto runs: the kind, the draft model or head it loads, and why (the
    first reason is the line the surfaces show)."""

    kind: str
    path: str | None
    reasons: tuple[str, ...]


class Pair:
    """The loaded target, its draft model and head, their drafters (built once per kind), and
    the target's engine.

    engines(lane) builds a lane's engine (default: a SpecEngine on the target; tests script
    one)."""

    def __init__(self, backend: Any, target: Any, draft: Any = None, head: str | None = None,
                 head_kind: str | None = None, mtp_layers: int | None = 0,
                 history: Any = None,
                 spec: LoadSpec | None = None,
                 engines: Callable[[str], Any] | None = None) -> None:
        self.backend, self.target, self.draft = backend, target, draft
        self.head, self.head_kind, self.mtp_layers = head, head_kind, mtp_layers
        self.history = history  # past replies (app/store/history.py) the lookup kinds read
        self.spec = spec
        self._drafters: dict[str, Any] = {}
        self._new_engine = engines or self._spec_engine
        self._engines: dict[str, Any] = {}

    @classmethod
    def of(cls, backend: Any, target: Any, draft: Any = None, head: str | None = None) -> Pair:
        """A pair over models already loaded (a test's, a second backend's): the head's kind
        read from its folder, the target's MTP layers left to the builder to find."""
        return cls(backend, target, draft, head=head, head_kind=folder_head_kind(head),
                   mtp_layers=None)

    @classmethod
    def open(cls, spec: LoadSpec, progress: Progress = lambda _stage: None,
             history: Any = None) -> Pair:
        """Resolve the spec's names, refuse a corrupt or missing file, load the target and
        the draft model (a head folder given as the draft is kept as the head), and read the
        head's kind and the target's MTP layers, once."""
        from app import store

        spec = spec.resolved()
        if not Path(spec.target).expanduser().exists():
            raise SpecdeckError(f"model not found: {spec.target}; give a .gguf file, an HF "
                                "folder or a pair id (`specdeck models` lists them, "
                                "`specdeck pull PAIR` downloads one)")
        head, draft_path = spec.head, spec.draft
        if draft_path and not head and folder_head_kind(draft_path):
            head, draft_path = draft_path, None
        store.check_file(spec.target)
        backend = load_backend(spec.backend)
        progress(f"loading the target {_base(spec.target)}")
        target = backend.load(spec.target, device=spec.device, dtype=spec.dtype)
        kind = (BY_NAME[spec.head_kind].built_as if spec.head_kind in drafters.HEADS
                else folder_head_kind(head))
        pair = cls(backend, target, head=head, head_kind=kind if head else None,
                   mtp_layers=mtp_layers_of(spec.target), history=history,
                   spec=replace(spec, draft=None, head=head))
        if draft_path:
            pair.load_draft(draft_path, progress)
        return pair

    @staticmethod
    def auto(spec: LoadSpec, given_draft: str | None = None) -> AutoChoice:
        """--drafter auto before anything loads (the choice decides what loads): the given
        draft model, else the planner's choice among the drafters that are downloaded (a
        missing one is named in the reasons, never fetched) and that the backend runs. The
        kind is the one to run (a draft model runs as its chain, lookup first)."""
        from app import store
        from app.catalogue import planner
        from backends import runs_of
        from backends.extras import files_of

        if given_draft:
            return AutoChoice("chain", given_draft,
                              (f"drafter: lookup, then the draft {given_draft} (given)",))
        backend = detect_backend() if spec.backend == "auto" else spec.backend
        files = files_of(backend)  # llama.cpp plans over the GGUF files pulled for torch
        try:
            plan = planner.plan(spec.target, files, spec.device, runs=runs_of(backend),
                                installed=lambda model: store.model_path(model, files))
        except SpecdeckError as error:
            return AutoChoice("ngram", None, ("drafter: ngram (the planner could not read "
                                              f"the target: {error})",))
        return AutoChoice(drafters.RUN_AS.get(plan.choice.kind, plan.choice.kind),
                          str(plan.choice.path) if plan.choice.path else None,
                          tuple(plan.reasons()))

    def load_draft(self, path: str, progress: Progress = lambda _stage: None) -> None:
        """Load a draft model beside the target (after a kind that drafts with one was
        chosen), in the spec's device and draft dtype, refused unless it shares the target's
        vocabulary."""
        from app import store

        spec = self.spec or LoadSpec(path)
        store.check_file(path)
        progress(f"loading the draft model {_base(path)}")
        draft = self.backend.load(path, device=spec.device, dtype=spec.draft_dtype or spec.dtype)
        check_vocab_compatible(self.target, draft)  # refused at load, not at the first draft
        self.draft, self.spec = draft, replace(spec, draft=path)
        self._drafters = {}

    def check(self, kind: str, tree: bool = False) -> Refusal | None:
        """Why kind (a "<kind>:tree" too) cannot run on this pair, or None: kinds.check with
        every fact of the loaded pair."""
        return check(kind, self._runs(),
                     capabilities=getattr(self.target, "capabilities", None), tree=tree,
                     has_draft=self.draft is not None, has_head=self.head is not None,
                     head_kind=self.head_kind, mtp_layers=self.mtp_layers,
                     target=getattr(self.target, "name", "this target"))

    def fallback(self, kind: str) -> tuple[str, Refusal | None]:
        """--drafter auto's last word on this pair: (kind, None) where it runs here, else
        the first of kinds.FALLBACKS that does (none at worst) and kind's refusal, so auto
        is never an error."""
        target = getattr(self.target, "name", "this target")
        chosen, refusal = fallback(kind, self._runs(),
                                   getattr(self.target, "capabilities", None), target)
        if refusal is None and (refusal := self.check(kind)) is None:
            return kind, None
        if chosen == kind or self.check(chosen) is not None:
            chosen = next((k for k in FALLBACKS if self.check(k) is None), "none")
        return chosen, refusal

    def _runs(self) -> Any:
        """The backend's declaration; a backend known only by name (a remote's, a test's) is
        read from the table of backends."""
        if self.backend is None:
            return None
        runs = getattr(self.backend, "runs", None)
        if runs is None:
            from backends import runs_of
            runs = runs_of(self.backend.name)
        return runs

    def require(self, kind: str, tree: bool = False) -> None:
        refusal = self.check(kind, tree)
        if refusal is not None:
            raise SpecdeckError(refusal.message)

    def drafter(self, kind: str, tree: bool = False, vocab_limit: int = 0) -> Any:
        """The drafter of kind ("<kind>:tree" drafts trees), built on first use and kept
        with its caches."""
        key = f"{kind}{'+tree' if tree else ''}@{vocab_limit}"
        if key not in self._drafters:
            self._drafters[key] = self.build(kind, tree=tree, vocab_limit=vocab_limit)
        return self._drafters[key]

    def build(self, kind: str, tree: bool = False, vocab_limit: int = 0) -> Any:
        """A new drafter of kind (a stream slot's own: a drafter keeps per-request state)."""
        base, suffixed = split(kind)
        self.require(kind, tree)
        return drafters.build_drafter(
            base, self.target, backend=self.backend, draft=self.draft,
            vocab_limit=vocab_limit, head=self.head if base in drafters.TAKES_HEAD else None,
            tree=tree or suffixed, history=self.history)

    def engine(self, lane: str = MAIN) -> Any:
        """The target's engine of a lane, built on first use. MAIN is the one engine every
        surface generates with: its session keeps the conversation's KV cache, its probed
        verify costs price k, and the history records its replies. Another lane (the race's
        plain lane, run beside it) has a session of its own and records nothing."""
        if lane not in self._engines:
            self._engines[lane] = self._new_engine(lane)
        return self._engines[lane]

    def fresh_engine(self) -> Any:
        """An engine over the target that the caller alone holds (a benchmark's): its runs
        neither touch the main lane's cache nor record into the history, and its cache goes
        when the caller drops it."""
        return self._new_engine("")

    def _spec_engine(self, lane: str) -> Any:
        from app.core.engine import SpecEngine

        return SpecEngine(self.target, recorder=self.history if lane == MAIN else None)

    def forget_drafters(self) -> None:
        """Drop the built drafters (a history turned off or cleared is read no more)."""
        self._drafters = {}


def installed_pair(target: str, files: str) -> tuple[Any, Any] | None:
    """(target path, draft path) when `target` names a catalogue pair rather than a path."""
    from app import store
    from app.catalogue import registry

    if Path(target).expanduser().exists() or target not in registry.load_catalogue().pairs:
        return None
    return store.installed_paths(target, files, need_draft=False)


def catalogue_folder(path: str | None, files: str) -> str | None:
    """A model (or head) given as a path, or as a catalogue model id `specdeck pull`
    installed: its folder."""
    from app import store
    from app.catalogue import registry

    models = registry.load_catalogue().models
    if not path or Path(path).expanduser().exists() or path not in models:
        return path
    found = store.model_path(models[path], files)
    if found is None:
        pairs = [p.id for p in registry.load_catalogue().pairs.values()
                 if p.drafter is not None and p.drafter.id == path]
        pull = f"`specdeck pull {pairs[0]}`" if pairs else "`specdeck pull`"
        raise SpecdeckError(f"{path} is not downloaded: {pull} fetches it")
    return str(found)


def folder_head_kind(path: str | None) -> str | None:
    """The kind of a head folder given as a draft: an EAGLE head's (its config and safetensors
    header, no torch), Gemma 4's assistant or a Qwen3.5 / 3.6 MTP layer published apart (its
    config's model_type)."""
    if not path:
        return None
    from backends.heads.assistant_format import is_assistant
    from backends.heads.eagle_format import head_kind
    from backends.heads.mtp_folder import is_mtp_folder

    if is_assistant(path):
        return "assistant"
    return "mtp" if is_mtp_folder(path) else head_kind(path)


def mtp_layers_of(target_path: str) -> int | None:
    """The target's own MTP layers, from its config; None when the planner cannot read it
    (the backend's builder then says whether it finds them)."""
    from app.catalogue import target_info

    try:
        return target_info.describe(target_path).arch.mtp_layers
    except Exception:  # noqa: BLE001 - an unread header leaves mtp to the builder; the load stands
        return None


def _base(path: str) -> str:
    return Path(path.rstrip("/")).name
