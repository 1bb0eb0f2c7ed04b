"""Where pulled models live under SPECDECK_HOME, and how a verified model enters it.

Knows: the folder layout and the completion marker. Must not know: where files come from.

    models/<model id>/<backend>/           what a backend loads: one .gguf file or an HF folder
    models/<model id>/<backend>/.specdeck-complete.json   written last; no marker, no model
    staging/<model id>/<backend>/          downloads in flight; kept until verified so an
                                           interrupted pull resumes on the next run
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from app.catalogue.registry import ModelSpec

MARKER = ".specdeck-complete.json"


def home() -> Path:
    return Path(os.environ.get("SPECDECK_HOME") or Path.home() / ".cache" / "specdeck")


def model_dir(model_id: str, backend: str) -> Path:
    return home() / "models" / model_id / backend


def staging_dir(model_id: str, backend: str) -> Path:
    return home() / "staging" / model_id / backend


def lock_path(model_id: str, backend: str) -> Path:
    return home() / "staging" / model_id / f".{backend}.lock"


def model_path(model: ModelSpec, backend: str) -> Path | None:
    """What the backend loads for an installed model, or None when it is not installed."""
    folder = model_dir(model.id, backend)
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    path = folder / marker.get("load", ".")
    return path if path.exists() else None


def disk_bytes(model: ModelSpec, backend: str) -> int:
    """Bytes under the model's folder, conversions (<file>.gguf.specdeck-hf/) included."""
    folder = model_dir(model.id, backend)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def install(model_id: str, backend: str, staged: list[tuple[Path, str]], load: str,
            source: str) -> None:
    """Move verified files into the model folder (renames), then write the marker last."""
    folder = model_dir(model_id, backend)
    folder.mkdir(parents=True, exist_ok=True)
    for path, name in staged:
        dest = folder / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
    marker = {"model": model_id, "backend": backend, "source": source, "load": load,
              "files": sorted(name for _, name in staged)}
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1), encoding="utf-8")
    os.replace(tmp, folder / MARKER)


def remove(model_id: str, backend: str) -> None:
    shutil.rmtree(model_dir(model_id, backend), ignore_errors=True)
    clear_staging(model_id, backend)


def clear_staging(model_id: str, backend: str) -> None:
    """Drop a finished (or abandoned) download's staging folder, its lock and empty parents."""
    staging = staging_dir(model_id, backend)
    shutil.rmtree(staging, ignore_errors=True)
    lock_path(model_id, backend).unlink(missing_ok=True)
    for folder in (staging.parent, staging.parent.parent):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
