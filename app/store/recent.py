"""Which pair the app used last, remembered under SPECDECK_HOME so the next start loads it.

Knows: the file (SPECDECK_HOME/recent.json, {"last_pair": id}). Must not know: whether the
pair is still installed (the caller checks), the UI. A store that cannot be written (read-only
home) forgets quietly: remembering is a convenience, never a reason to fail a load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from app.paths import home


def _path() -> Path:
    return home() / "recent.json"


def last_pair() -> str | None:
    """The pair id used last, or None (never used, or the file is unreadable)."""
    try:
        data = json.loads(_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    pair = data.get("last_pair") if isinstance(data, dict) else None
    return pair if isinstance(pair, str) else None


def remember_pair(pair_id: str) -> None:
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".recent.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"last_pair": pair_id}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
