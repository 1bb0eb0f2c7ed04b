"""Gemma 4's assistant folder as a draft, without an array library: how it is recognised,
which target layers lend it keys and values, and whether an assistant fits a target.

Knows: its config's model_type (transformers' `gemma4_assistant`) and fields (text_config,
backbone_hidden_size, use_ordered_embeddings), Gemma 4's KV sharing (the last layer of each
attention type before the shared ones "stores" what the assistant reads), the assistant's
sliding read (transformers' bidirectional sliding mask, flipped: the last window + 1 rows).
Configs are read by attribute or key alike (transformers' configs, mlx-lm's ModelArgs, dicts).
Must not know: an array library, the drafting (backends/heads/assistant_drafter.py), the
weights (backends/{torch,mlx}/head_weights/assistant.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.core.types import SpecdeckError

ASSISTANT = "gemma4_assistant"
TARGETS = ("gemma4", "gemma4_text")


def is_assistant(path: str | Path | None) -> bool:
    """Whether the folder holds a Gemma 4 assistant (its config.json says so; never raises)."""
    try:
        config = read_config(path)
    except SpecdeckError:
        return False
    return config.get("model_type") == ASSISTANT


def read_config(path: str | Path | None) -> dict[str, Any]:
    """The folder's config.json; SpecdeckError when it has none that reads as a dict."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, TypeError, ValueError) as error:
        raise SpecdeckError(f"cannot read the assistant's config.json in {path}: "
                            f"{error}") from error
    if not isinstance(config, dict):
        raise SpecdeckError(f"{path}/config.json is not a config")
    return config


def field(config: Any, name: str, default: Any = None) -> Any:
    """A config field, read from an object or a dict."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def store_layers(config: Any, target: str) -> dict[str, int]:
    """Per attention type, the target layer whose keys and values the assistant reads: the
    last one of that type before the target's own KV sharing starts (transformers'
    kv_sharing_modes "store"). SpecdeckError where none can be read from a captured input."""
    types: Sequence[str] = field(config, "layer_types") or ()
    first_shared = len(types) - int(field(config, "num_kv_shared_layers") or 0)
    stores = {kind: i for i, kind in enumerate(types[:first_shared])}
    if not stores:
        raise SpecdeckError(f"{target}'s config names no layer that stores its keys and values "
                            "for the assistant: is it a Gemma 4?")
    if min(stores.values()) < 1:
        raise SpecdeckError(f"{target}: a store layer at index 0 reads the embeddings, which "
                            "specdeck does not capture; pick another drafter")
    return stores


def check_target(folder: str, target: str, model_types: Sequence[str]) -> None:
    """SpecdeckError naming the fix unless one of the target's model types (its config's,
    its text config's) is a Gemma 4's."""
    if not set(model_types) & set(TARGETS):
        raise SpecdeckError(f"{folder} is a Gemma 4 assistant, which drafts for Gemma 4 "
                            f"targets only, not {target}: pick another drafter")


def check_fit(folder: str, target: str, *, hidden: int, vocab: int, backbone: int,
              assistant_vocab: int, assistant_types: Sequence[str],
              stores: dict[str, int]) -> None:
    """SpecdeckError naming the fix where the assistant was built for another Gemma 4."""
    if backbone != hidden or assistant_vocab != vocab:
        raise SpecdeckError(f"{folder} was trained for a Gemma 4 of hidden size {backbone} and "
                            f"vocabulary {assistant_vocab}; {target} has {hidden} and {vocab}: "
                            "pass the assistant published with it")
    unread = sorted(set(assistant_types) - set(stores))
    if unread:
        raise SpecdeckError(f"{folder}'s layers attend to {', '.join(unread)} keys, which "
                            f"{target} stores none of: pass the assistant published with it")


def sliding_read(text_config: dict[str, Any]) -> int:
    """How many of the last sliding rows one assistant query reads, from its text_config as
    config.json holds it: transformers' window (halved plus one where every token attends
    both ways, as its config does on load) + 1, the rows within that distance of the
    query's, flipped to the past."""
    window = int(field(text_config, "sliding_window") or 0)
    if field(text_config, "use_bidirectional_attention") == "all":
        window = window // 2 + 1
    return window + 1
