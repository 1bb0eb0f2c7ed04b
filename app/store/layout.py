"""Where pulled models live under SPECDECK_HOME, and how a verified model enters it.

Knows: the folder layout, the completion marker and the file records it holds. Must not know:
where files come from.

    models/<model id>/<backend>/           what a backend loads: one .gguf file or an HF folder
    models/<model id>/<backend>/.specdeck-complete.json   written last; no marker, no model.
                                           It records each file's size, mtime and sha256.
    staging/<model id>/<backend>/          downloads in flight; kept until verified so an
                                           interrupted pull resumes on the next run
    locks/<model id>.<backend>.lock        one pull per model at a time; never deleted, since
                                           a waiting pull holds it open
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from app.catalogue.registry import ModelSpec
from app.paths import home
from app.store import integrity
from app.store.integrity import FileRecord
from backends.extras import files_of

MARKER = ".specdeck-complete.json"


def model_dir(model_id: str, backend: str) -> Path:
    """The folder of a model's files for a backend (llama.cpp reads the GGUF pulled for torch)."""
    return home() / "models" / model_id / files_of(backend)


def staging_dir(model_id: str, backend: str) -> Path:
    return home() / "staging" / model_id / backend


def lock_path(model_id: str, backend: str) -> Path:
    # outside staging/, which a finished pull removes while another may wait on the lock
    return home() / "locks" / f"{model_id}.{backend}.lock"


def read_marker(model_id: str, backend: str) -> dict[str, Any] | None:
    """The completion marker of an installed model, or None."""
    try:
        marker = json.loads((model_dir(model_id, backend) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def model_path(model: ModelSpec, backend: str) -> Path | None:
    """What the backend loads for an installed model, or None when it is not installed."""
    marker = read_marker(model.id, backend)
    if marker is None:
        return None
    path = model_dir(model.id, backend) / marker.get("load", ".")
    return path if path.exists() else None


def records(marker: dict[str, Any], expected: dict[str, str]) -> tuple[FileRecord, ...]:
    """The marker's file records. A marker from before records existed gets them now: a file
    whose sha256 the source promised (`expected`, name -> sha256) is checked against it by
    one forced rehash; any other is recorded as it is (trusted once, like at its install)."""
    listed = marker.get("records")
    if isinstance(listed, dict):
        return tuple(FileRecord.from_dict(name, data) for name, data in sorted(listed.items()))
    folder = model_dir(str(marker.get("model")), str(marker.get("backend")))
    return tuple(_adopt(folder, name, expected.get(name)) for name in marker.get("files") or [])


def _adopt(folder: Path, name: str, sha256: str | None) -> FileRecord:
    if sha256 is None and (folder / name).is_file():
        return integrity.record(folder, name)
    return FileRecord(name, integrity.UNKNOWN, integrity.UNKNOWN, sha256 or "")


def disk_bytes(model: ModelSpec, backend: str) -> int:
    """Bytes under the model's folder, conversions (<file>.gguf.specdeck-hf/) included."""
    folder = model_dir(model.id, backend)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def install(model_id: str, backend: str, staged: list[tuple[Path, str, str | None]],
            load: str, source: str) -> None:
    """Move verified files (path, name, sha256 if known) into the model folder by rename,
    record each one, then write the marker last."""
    folder = model_dir(model_id, backend)
    folder.mkdir(parents=True, exist_ok=True)
    recs = []
    for path, name, sha256 in staged:
        dest = folder / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        recs.append(integrity.record(folder, name, sha256))  # the mtime after the rename
    marker = {"model": model_id, "backend": backend, "source": source, "load": load,
              "files": sorted(name for _, name, _ in staged)}
    write_marker(model_id, backend, marker, tuple(recs))


def write_marker(model_id: str, backend: str, marker: dict[str, Any],
                 recs: tuple[FileRecord, ...]) -> None:
    """Atomically (re)write the marker with these records; a unique temporary name keeps two
    processes that refresh it at once from tripping over each other."""
    folder = model_dir(model_id, backend)
    data = {**marker, "records": {r.name: r.to_dict() for r in recs}}
    fd, tmp = tempfile.mkstemp(prefix=MARKER, suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, folder / MARKER)
    finally:
        Path(tmp).unlink(missing_ok=True)


def restage(model_id: str, backend: str, good: list[str], bad: list[str]) -> None:
    """Undo an install that failed its check: the marker goes first (no longer installed),
    bad files are deleted, good ones move back to staging so the next pull keeps them."""
    folder, staging = model_dir(model_id, backend), staging_dir(model_id, backend)
    (folder / MARKER).unlink(missing_ok=True)
    for name in bad:
        (folder / name).unlink(missing_ok=True)
    for name in good:
        dest = staging / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(folder / name, dest)


def remove(model_id: str, backend: str) -> None:
    shutil.rmtree(model_dir(model_id, backend), ignore_errors=True)
    clear_staging(model_id, backend)


def clear_staging(model_id: str, backend: str) -> None:
    """Drop a finished (or abandoned) download's staging folder and its empty parents; the
    lock stays (another pull may be waiting on it)."""
    staging = staging_dir(model_id, backend)
    shutil.rmtree(staging, ignore_errors=True)
    for folder in (staging.parent, staging.parent.parent):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
