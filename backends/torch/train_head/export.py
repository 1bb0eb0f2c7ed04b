"""Write a trained head as an EAGLE-3 folder that vLLM, SGLang and the EAGLE code load unchanged.

Knows: the dtype heads are published in (bf16) and the training record kept beside the
weights (specdeck.json, which engines ignore). The layout itself (HEADS.md 1.1 format A:
config.json, `fc`, `midlayer.*`, `norm`, `lm_head`, int64 `d2t`, bool `t2d`, no layer ids
for a head on the default layers) is written by backends/torch/head_weights/eagle.save_eagle3.
Must not know: training.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from backends.torch.head_weights.eagle import Eagle3Head, save_eagle3


def export(head: Eagle3Head, folder: Path, dtype: torch.dtype = torch.bfloat16,
           extra: dict[str, Any] | None = None) -> Path:
    """config.json + model.safetensors (+ specdeck.json with `extra`) in `folder`."""
    published = copy.deepcopy(head).to(device="cpu", dtype=dtype)  # d2t/t2d keep their types
    save_eagle3(published, folder)
    if extra is not None:
        (folder / "specdeck.json").write_text(json.dumps(extra, indent=1), encoding="utf-8")
    return folder
