"""A backend's table of builders: kind -> the name of the function that builds its drafter.

Knows: how a table entry becomes a call (the builders' module is imported on use, so a
backend's RUNS, which is `frozenset(BUILDERS)`, is read without importing its array library).
Must not know: which kinds exist or whether one runs here (app/drafters/kinds.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from app.core.protocols import DrafterRequest


def build(builders: Mapping[str, str], module: str, request: DrafterRequest) -> Any:
    """The drafter of request.kind, made by the function of `module` that the table names."""
    return getattr(importlib.import_module(module), builders[request.kind])(request)
