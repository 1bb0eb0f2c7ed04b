"""Gemma 4's assistant folder as a draft: how it is recognised, without torch.

Knows: its config's model_type (transformers' `gemma4_assistant`). Must not know: an array
library, the drafting (backends/torch/head_weights/assistant.py).
"""

from __future__ import annotations

import json
from pathlib import Path

ASSISTANT = "gemma4_assistant"


def is_assistant(path: str | Path | None) -> bool:
    """Whether the folder holds a Gemma 4 assistant (its config.json says so; never raises)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, TypeError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == ASSISTANT
