"""A backend's table of builders: kind -> the name of the function that builds its drafter,
and the builders every backend makes alike (a draft model, a head from its folder, the
target's own layers) from the loader it names.

Knows: how a table entry becomes a call (the builders' module is imported on use, so a
backend's RUNS, which is `frozenset(BUILDERS)`, is read without importing its array library;
a named loader's module likewise, when its kind is built). Must not know: which kinds exist
or whether one runs here (app/drafters/kinds.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from app.core.protocols import DrafterRequest

Builder = Callable[[DrafterRequest], Any]


def build(builders: Mapping[str, str], module: str, request: DrafterRequest) -> Any:
    """The drafter of request.kind, made by the function of `module` that the table names."""
    return getattr(importlib.import_module(module), builders[request.kind])(request)


def draft_model_builder(module: str, drafter: str) -> Builder:
    """A builder of `module.drafter` over the target and the draft model, in its vocabulary."""
    def build_draft_model(request: DrafterRequest) -> Any:
        made = _named(module, drafter)
        return made(request.target, request.draft, vocab_limit=request.vocab_limit)
    return build_draft_model


def head_builder(module: str, loader: str) -> Builder:
    """A builder that calls `module.loader(target, head folder)`."""
    def build_head(request: DrafterRequest) -> Any:
        return _named(module, loader)(request.target, request.head)
    return build_head


def own_layers_builder(module: str, loader: str) -> Builder:
    """A builder that calls `module.loader(target, head folder or None)`: layers of the
    target's own checkpoint, or of a folder published apart in their place (a SpecdeckError
    when there are none)."""
    def build_own_layers(request: DrafterRequest) -> Any:
        return _named(module, loader)(request.target, request.head)
    return build_own_layers


def _named(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)
