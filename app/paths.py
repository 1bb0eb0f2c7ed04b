"""SPECDECK_HOME: the one folder specdeck keeps its models, trained heads and records in.

Knows: the environment variable and its default. Must not know: what lies under it (a leaf:
the store, the catalogue and training each name their own subfolders).
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("SPECDECK_HOME") or Path.home() / ".cache" / "specdeck")
