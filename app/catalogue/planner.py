"""Choose the drafter for a target: the first kind of the preference order that has a
candidate, runs here, fits in memory and is installed or shipped, with the reason each other
kind was passed over.

Knows: the preference order (app/catalogue/preference.py), a target's numbers
(app/catalogue/target_info.py), memory sizing (app/catalogue/sizing.py) and this machine's
memory and dtypes (app/catalogue/hardware.py), a trained head's recorded τ. Must not know:
downloads, array libraries (app/ never imports torch), whether a kind runs on a backend
(app/drafters/kinds.py's check says, as it does for every surface).

API:
    plan(target, backend, device, memory, context, catalogue, installed, runs)
        -> Plan
        Plan.choice (an Option: kind, model, reason), Plan.refused (each with its reason),
        Plan.passed (usable, but ranked after the choice), Plan.absent (kinds of the order
        with no candidate for this target, and why), Plan.reasons() as lines for a terminal
        or the UI.
    preference(backend, device) -> the kinds in the order tried on that backend and device
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.catalogue.hardware import available_memory, dtype_for, resolve_device
from app.catalogue.preference import DRAFT, HEAD_KINDS, MODEL_FREE, OWN, PREFERENCE, RANKS, SHIPPED
from app.catalogue.registry import Catalogue, ModelSpec, load_catalogue
from app.catalogue.sizing import (
    Fit,
    Sizing,
    _gb,
    _target_source,
    arch_sizing,
    drafter_sizing,
    fit,
    model_sizing,
    state_slots,
    verify_state,
    weights_bytes,
)
from app.catalogue.target_info import TargetInfo, describe
from app.core.protocols import Runs
from app.drafters.kinds import chains_only, check

MAX_DRAFT_RATIO = 1 / 3  # a draft model larger than this share of the target rarely pays off
# a head whose training recorded a held-out τ (tokens per step: 1 + its chained accuracy)
# below this is passed over: a head trained in 20 s on 24 prompts recorded τ 1.008, was chosen
# over prompt lookup, and its first reply ran at 0.70x plain with acceptance 0
MIN_HEAD_TAU = 1.2
HEAD_RECORD = "specdeck.json"  # what train-head writes beside a head's weights


@dataclass(frozen=True)
class Option:
    """A drafter considered for a target: chosen or refused, with the reason."""

    kind: str
    reason: str
    model: ModelSpec | None = None
    pair_id: str | None = None
    path: Path | None = None  # where the drafter model is installed, when it is
    k: int = 4

    @property
    def label(self) -> str:
        return f"{self.kind} {self.model.id}" if self.model else self.kind


@dataclass(frozen=True)
class Plan:
    target: TargetInfo
    choice: Option
    fit: Fit
    refused: tuple[Option, ...] = field(default=())
    passed: tuple[Option, ...] = field(default=())  # usable, ranked after the choice
    absent: tuple[Option, ...] = field(default=())  # kinds in the order with no candidate here

    def reasons(self) -> list[str]:
        lines = [f"drafter: {self.choice.label} ({self.choice.reason})"]
        lines += [f"not {o.label}: {o.reason}" for o in self.refused]
        lines += [f"not {o.label}: ranked after {self.choice.kind} ({o.reason})"
                  for o in self.passed]
        if self.absent:
            lines.append(_absent_line(self.absent))
        if not self.fit.target_fits:
            lines.append(f"warning: {self.fit.summary()}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        def option(o: Option) -> dict[str, Any]:
            return {"kind": o.kind, "model": o.model.id if o.model else None,
                    "pair": o.pair_id, "reason": o.reason, "k": o.k,
                    "path": str(o.path) if o.path else None}
        return {"target": self.target.label, "choice": option(self.choice),
                "refused": [option(o) for o in self.refused],
                "passed": [option(o) for o in self.passed],
                "absent": [option(o) for o in self.absent], "fit": self.fit.to_dict()}


def _absent_line(absent: tuple[Option, ...]) -> str:
    """One line for the kinds that had no candidate, grouped by why: "none here: mtp (the
    target carries no MTP layers); eagle, medusa (the catalogue ships none for this target)"."""
    groups: dict[str, list[str]] = {}
    for option in absent:
        groups.setdefault(option.reason, []).append(option.kind)
    return "none here: " + "; ".join(f"{', '.join(kinds)} ({reason})"
                                      for reason, kinds in groups.items())


Installed = Callable[[ModelSpec], Path | None]


def plan(target: str | TargetInfo, backend: str = "torch", device: str = "auto",
         memory: int | None = None, context: int = 4096, catalogue: Catalogue | None = None,
         installed: Installed | None = None, runs: Runs | None = None) -> Plan:
    """The drafter for a target: the first in `preference` order that runs here
    (kinds.check), is available and fits; every other candidate is refused or passed over,
    with its reason.

    installed: when given, the local path of a drafter model or None when it is not
    downloaded (a drafter that is not downloaded is refused, never fetched silently).
    runs: what the backend that runs the drafters runs, when it is not `backend` (llama.cpp
    plans over the GGUF files pulled for torch); else `backend`'s own.
    """
    from backends import runs_of

    catalogue = catalogue or load_catalogue()
    info = describe(target, catalogue) if isinstance(target, str) else target
    device = resolve_device(backend, device)
    local_gguf = info.path is not None and info.path.suffix == ".gguf"
    dtype = dtype_for(backend, device, *_target_source(info, backend),
                      gguf=True if local_gguf else None)  # None: read from the format
    memory = available_memory(backend, device) if memory is None else memory
    ctx = _Context(info, backend, device, dtype, memory, context, installed,
                   runs or runs_of(backend))
    refused: list[Option] = []
    usable: list[Option] = []
    candidates = _candidates(info, catalogue)
    for candidate in ordered(candidates, backend, device):
        problem = ctx.problem(candidate)
        if problem:
            refused.append(Option(candidate.kind, problem, candidate.model, candidate.pair_id,
                                  k=candidate.k))
            continue
        path = installed(candidate.model) if installed and candidate.model else None
        usable.append(Option(candidate.kind, candidate.reason, candidate.model,
                             candidate.pair_id, path, candidate.k))
    if not usable:  # only where the target cannot speculate: every kind is refused
        usable.append(Option("none", "no drafter applies here: plain decoding"))
    choice, *passed = usable
    return Plan(info, choice, ctx.fit(choice), tuple(refused), tuple(passed),
                _absent(info, candidates, preference(backend, device)))


def preference(backend: str, device: str) -> tuple[str, ...]:
    """Drafter kinds, best first, on this backend and device.

    The model-free pair swaps off CUDA: on a CPU or an Apple GPU a verify row costs about as
    much as a decoded token, so lookahead's wide tree loses to lookup (measured in
    docs/PERFORMANCE.md, drafters that need no model), while a GPU verifies the rows nearly
    for free.
    """
    kinds = [rank.name for rank in PREFERENCE]
    if backend == "mlx" or not device.startswith("cuda"):
        i, j = kinds.index("lookahead"), kinds.index("ngram")
        kinds[i], kinds[j] = kinds[j], kinds[i]
    return tuple(kinds)


def ordered(options: list[Option], backend: str, device: str) -> list[Option]:
    """Options in preference order; a kind's own options keep their order (pair first)."""
    rank = {kind: i for i, kind in enumerate(preference(backend, device))}
    return sorted(options, key=lambda o: rank.get(o.kind, len(rank)))


@dataclass(frozen=True)
class _Context:
    info: TargetInfo
    backend: str
    device: str
    dtype: str
    memory: int
    context: int
    installed: Installed | None
    runs: Runs

    def target_sizing(self) -> Sizing:
        info = self.info
        if info.path is None and info.model is not None:
            return model_sizing(info.model, self.backend, self.dtype)
        weights = weights_bytes(info.params, self.backend, self.dtype, None)
        if info.path is not None and (self.backend == "mlx" or self.dtype == "gguf"):
            weights = _disk_bytes(info.path)  # kept as it is on disk
        return arch_sizing(info.arch, weights, self.backend, self.dtype)

    def fit(self, option: Option) -> Fit:
        drafter = drafter_sizing(option.kind, option.model, self.info.arch, self.backend,
                                 self.dtype)
        verify = verify_state(option.kind, option.k, self.info.arch,
                              option.model.arch if option.model else None, self.dtype)
        slots = state_slots(option.kind, option.k, self.info.arch, self.dtype)
        return fit(self.target_sizing(), drafter, self.memory, self.context, self.backend,
                   self.device, self.dtype, verify, slots,
                   option.k if option.kind != "none" else 0)

    def problem(self, option: Option) -> str:
        """Why this drafter cannot be used here, or '' when it can."""
        refusal = check(option.kind, self.runs)
        if refusal is not None:
            return refusal.message
        shrinks = chains_only(option.kind, self.runs)
        if shrinks:
            return shrinks  # it runs, but pays less than it does where trees are verified
        if option.kind in MODEL_FREE:
            return ""  # no weights, no KV cache of its own: it fits wherever the target does
        if option.kind == "draft" and option.model.params > self.info.params * MAX_DRAFT_RATIO:
            share = option.model.params / self.info.params
            return f"too large to pay off: {share:.0%} of the target's parameters"
        if option.model is not None:
            sources = option.model.sources_for(self.backend)
            if not sources:
                return f"{option.model.id} has no {self.backend} source"
            if all(s.format.startswith("pytorch") for s in sources):
                return (f"{option.model.id} ships only a pickle checkpoint, which specdeck never "
                        "loads (safetensors only)")
            path = self.installed(option.model) if self.installed is not None else None
            if self.installed is not None and path is None:
                pull = f"specdeck pull {option.pair_id}" if option.pair_id else "a pull"
                return f"{option.model.id} is not downloaded (`{pull}` fetches it)"
            tau = recorded_tau(path) if option.kind in HEAD_KINDS and path else None
            if tau is not None and tau < MIN_HEAD_TAU:
                return (f"its training recorded a held-out τ of {tau:.3f} tokens per step, "
                        f"under the {MIN_HEAD_TAU} a head needs to pay for its drafting: "
                        "train it on more prompts (`specdeck train-head`)")
        result = self.fit(option)
        if not result.target_fits and option.model is not None:
            return f"the target alone does not fit ({result.summary()})"
        if not result.fits:
            extra = (result.drafter_weights_bytes + result.kv_bytes(self.context)
                     - result.kv_bytes(self.context, speculating=False))
            return (f"does not fit: its weights and KV cache need {_gb(extra)} more for one "
                    f"stream of {self.context} tokens; {_gb(result.usable_bytes)} usable")
        return ""


def _candidates(info: TargetInfo, catalogue: Catalogue) -> list[Option]:
    """Every drafter worth considering for this target, each with its case (`ordered` ranks
    them)."""
    why = {rank.name: rank.why for rank in PREFERENCE}
    found: list[Option] = []
    if info.arch.mtp_layers > 0:
        found.append(Option("mtp", f"the target carries {info.arch.mtp_layers} native MTP "
                            f"layer(s): {why['mtp']}", k=info.arch.mtp_layers))
    pairs = [p for p in catalogue.pairs.values()
             if info.model is not None and p.target.id == info.model.id]
    for p in pairs:
        if p.drafter_kind in HEAD_KINDS:
            found.append(Option(p.drafter_kind, f"trained for this target: {why[p.drafter_kind]}",
                                p.drafter, p.id, k=p.k))
    seen: set[str] = set()
    for p in pairs:
        if p.drafter_kind == "draft":
            seen.add(p.drafter.id)
            found.append(Option("draft", "the catalogue's draft model for this target",
                                p.drafter, p.id, k=p.k))
    if info.model is not None:
        for model in catalogue.draft_models_for(info.model):
            if model.id not in seen:
                found.append(_family_draft(model, info, catalogue))
    found.append(Option("lookahead", "needs no model: Jacobi iteration drafts n-grams the "
                        f"target itself proposes; {why['lookahead']}"))
    found.append(Option("ngram", "needs no model or memory: drafts repeats of the prompt and "
                        "output"))
    return found


def _absent(info: TargetInfo, candidates: list[Option],
            kinds: tuple[str, ...]) -> tuple[Option, ...]:
    """The kinds of the order with no candidate for this target, each with why."""
    offered = {o.kind for o in candidates}
    own = (f"its config declares {info.mtp_dropped} MTP layer(s) but its files hold none (a "
           "conversion dropped them): --draft MTP_DIR gives them back" if info.mtp_dropped
           else "the target carries no MTP layers")
    why = {OWN: own,
           SHIPPED: "the catalogue ships none for this target",
           DRAFT: f"the catalogue has no smaller {info.family} model" if info.family
           else "its family is unknown, so no draft model is known to share its tokenizer"}
    return tuple(Option(kind, why[RANKS[kind].source]) for kind in kinds
                 if kind not in offered and RANKS[kind].source in why)


def _family_draft(model: ModelSpec, info: TargetInfo, catalogue: Catalogue) -> Option:
    pair_id = next((p.id for p in catalogue.pairs.values()
                    if p.drafter is not None and p.drafter.id == model.id
                    or p.target.id == model.id), None)
    return Option("draft", f"a smaller model of the {info.family} family (same tokenizer)",
                  model, pair_id)


def recorded_tau(folder: Path) -> float | None:
    """The held-out τ a trained head's record gives, or None (published heads have none)."""
    try:
        record = json.loads((Path(folder) / HEAD_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    tau = record.get("held_out_tau") if isinstance(record, dict) else None
    return float(tau) if isinstance(tau, (int, float)) else None


def _disk_bytes(path: Path) -> int:
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)
