"""Header-only GGUF files: an architecture, the fields a test writes, and one small tensor.

Enough for what reads a header (the file type, the architecture) or refuses a family before
its tensors; no model behind them (tests/tiny.py writes GGUFs of real tiny weights)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def header_gguf(path: Path, architecture: str = "llama",
                fields: Callable[[Any], None] = lambda _writer: None) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    fields(writer)
    writer.add_tensor("t", np.zeros((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
