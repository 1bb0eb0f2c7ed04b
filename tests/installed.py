"""A SPECDECK_HOME whose installed pairs a test chooses: tiny models installed under catalogue
model ids (seconds), or the real SmolLM2 linked from the user's store (no copy, no download).

The store sees them as it sees pulled models (a marker with file records, app/store/layout.py);
the planner sizes them from the catalogue's numbers, so memory budgets in tests are exact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from app.store import layout
from tests.serving import save_tiny_model

REAL_HOME = Path(os.environ.get("SPECDECK_HOME") or Path.home() / ".cache" / "specdeck")


def install_tiny(home: Path, model_id: str, seed: int = 1, backend: str = "torch") -> Path:
    """The tiny model of tests/tiny.py (with a chat template) installed as `model_id` under home."""
    staged = save_tiny_model(home / "build" / model_id, seed=seed)
    names = sorted(p.name for p in staged.iterdir() if p.is_file())
    with _home(home):
        layout.install(model_id, backend, [(staged / n, n, None) for n in names], load=".",
                       source="test")
        folder = layout.model_dir(model_id, backend)
    shutil.rmtree(staged)
    return folder


def link_installed(home: Path, model_id: str, backend: str = "torch") -> Path | None:
    """Link an installed model of the real store into home; None when it is not installed."""
    real = REAL_HOME / "models" / model_id / backend
    if not (real / layout.MARKER).is_file():
        return None
    link = home / "models" / model_id / backend
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(real, target_is_directory=True)
    return link


class _home:
    """SPECDECK_HOME set to home inside the block (the store reads it on each call)."""

    def __init__(self, home: Path) -> None:
        self.home, self.before = home, None

    def __enter__(self) -> None:
        self.before = os.environ.get("SPECDECK_HOME")
        os.environ["SPECDECK_HOME"] = str(self.home)

    def __exit__(self, *exc: object) -> None:
        if self.before is None:
            os.environ.pop("SPECDECK_HOME", None)
        else:
            os.environ["SPECDECK_HOME"] = self.before
