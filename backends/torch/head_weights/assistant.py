"""Gemma 4's assistant on torch: transformers' own `gemma4_assistant` module as the step of
backends/heads/assistant_drafter.py, the target's store layers recomputing its keys and
values, and the loader.

Knows: transformers' Gemma4AssistantForCausalLM (its inputs_embeds, position_ids and
shared_kv_states; its own masks pick the rows it reads), the target's Gemma 4 modules (the
embedding, final norm, rotary embedding, a store layer's projections and norms). Must not
know: the drafting (backends/heads/assistant_drafter.py), the folder's format and the pair's
checks (backends/heads/assistant_format.py), surfaces, the engine's loop.
"""

from __future__ import annotations

from typing import Any

import torch

from app.core.types import SpecdeckError
from backends.heads.assistant_drafter import AssistantDrafter
from backends.heads.assistant_format import check_fit, check_target, field, store_layers
from backends.torch.arrays import TorchArrays


class TorchAssistantStep:
    """The assistant and the target's parts it reads, on the target's device."""

    def __init__(self, assistant: Any, target: Any) -> None:
        self.assistant, self.target = assistant, target
        model = target.hf.model
        self.embed, self.final_norm, self._rotary = model.embed_tokens, model.norm, \
            model.rotary_emb

    def run(self, inputs: torch.Tensor, position: int,
            shared: dict[str, tuple[torch.Tensor, torch.Tensor]]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.tensor([[position]], device=inputs.device)
        batched = {kind: (keys[None], values[None]) for kind, (keys, values) in shared.items()}
        out = self.assistant(inputs_embeds=inputs[None].to(self.assistant.dtype),
                             position_ids=positions, shared_kv_states=batched, use_cache=False)
        return out.logits[0], out.last_hidden_state[0].to(inputs.dtype)

    def keys_values(self, index: int, rows: torch.Tensor, first_position: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The store layer's keys and values [kv heads, rows, head dim] of rows [rows, H] at
        positions first_position.., as its attention computes them."""
        from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

        layer = self.target.layers[index]
        attention, x = layer.self_attn, layer.input_layernorm(rows[None])
        positions = torch.arange(first_position, first_position + rows.shape[0],
                                 device=rows.device)
        shape = (*x.shape[:-1], -1, attention.head_dim)
        keys = attention.k_proj(x).view(shape)
        values = attention.v_proj(x).view(shape) if attention.v_proj is not None else keys
        cos, sin = self._rotary(x, positions[None], attention.layer_type)
        keys = apply_rotary_pos_emb(attention.k_norm(keys), cos, sin, unsqueeze_dim=2)
        return keys.transpose(1, 2)[0], attention.v_norm(values).transpose(1, 2)[0]


def load_assistant_drafter(target: Any, folder: str) -> AssistantDrafter:
    """The drafter over the Gemma 4 assistant in folder, for target; SpecdeckError naming
    the fix when either is not what the other needs."""
    config = target.hf.config.get_text_config()
    check_target(folder, target.name, (field(config, "model_type", ""),
                                       field(target.hf.config, "model_type", "")))
    stores = store_layers(config, target.name)
    assistant = _load(folder, target)
    text = assistant.config.get_text_config()
    check_fit(folder, target.name, hidden=int(config.hidden_size), vocab=int(target.vocab_size),
              backbone=int(assistant.config.backbone_hidden_size),
              assistant_vocab=int(text.vocab_size), assistant_types=text.layer_types,
              stores=stores)
    return AssistantDrafter(TorchAssistantStep(assistant, target), TorchArrays(target.device),
                            stores=stores, window=int(config.sliding_window or 0),
                            last_layer=target.n_layers - 1)


def _load(folder: str, target: Any) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=target.hf.dtype,
                                                     use_safetensors=True)
    except (OSError, ValueError) as error:
        raise SpecdeckError(f"cannot load the assistant in {folder}: {error}") from error
    return model.to(target.device).eval()
