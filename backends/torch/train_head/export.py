"""Write a trained head as an EAGLE-3 folder that vLLM, SGLang and the EAGLE code load unchanged.

Knows: HEADS.md 1.1 format A (the authors' `midlayer.*` names; vLLM maps them to `layers.0.*`,
SGLang through its legacy name map): config.json with the draft layer's own Llama config plus
`draft_vocab_size`, and model.safetensors with `fc`, `midlayer.*`, `norm`, `lm_head`, int64
`d2t` and bool `t2d`, no `embed_tokens` (the target's table is shared, as in the authors' 8B
heads). No `eagle_config` layer ids are written: engines then read the default layers
[2, N//2, N-3] (capture-before), the ones the head was trained on, and the SGLang/vLLM
disagreement over explicit ids (HEADS.md 0.1) cannot arise. Must not know: training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from backends.torch.train_head.head import Eagle3TrainHead, HeadShape

WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # SpecForge's name; vLLM's registry maps it to Eagle3


def head_config(shape: HeadShape, dtype: torch.dtype) -> dict[str, Any]:
    return {"architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
            "head_dim": shape.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
            "rms_norm_eps": shape.rms_norm_eps, "max_position_embeddings": shape.max_positions,
            "rope_theta": shape.rope_theta, "rope_scaling": None, "attention_bias": False,
            "mlp_bias": False, "tie_word_embeddings": False, "vocab_size": shape.vocab,
            "draft_vocab_size": shape.draft_vocab,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def export(head: Eagle3TrainHead, folder: Path, dtype: torch.dtype = torch.bfloat16,
           extra: dict[str, Any] | None = None) -> Path:
    """config.json + model.safetensors in `folder`; `extra` goes to specdeck.json (how the
    head was trained: target, prompts, accuracy), which engines ignore."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in head.state_dict().items():
        value = value.detach().cpu()
        tensors[name] = value.to(dtype) if value.is_floating_point() else value
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(head_config(head.shape, dtype), indent=2),
                                        encoding="utf-8")
    if extra is not None:
        (folder / "specdeck.json").write_text(json.dumps(extra, indent=1), encoding="utf-8")
    return folder
