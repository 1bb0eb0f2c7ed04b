"""Gemma 4's assistant on torch: a small drafter that reads the target's own keys and values
(transformers' `gemma4_assistant`), its loader and its drafting.

Knows: the assistant's inputs as transformers' SinglePositionMultiTokenCandidateGenerator
feeds them: `cat(target embedding of the last token, the target's final-norm state before
it)`, at that token's position, held for the whole chain; `shared_kv_states`, the keys and
values of the target's last "store" layer of each attention type over the committed
positions (sliding layers: a window's worth and more, of which the assistant's own mask reads
the last ones); each later draft reads the
assistant's own projected state and its last token. The keys and values are recomputed here
from each committed row's input to the store layer (the previous layer's output, captured),
with the store layer's own projections, norms and RoPE, so the target's cache is never read.
Must not know: the engine's loop, verification, surfaces, other drafters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from app.core.protocols import StepFeed
from app.core.types import Draft, SamplingParams, SpecdeckError

_TARGETS = ("gemma4", "gemma4_text")


class AssistantDrafter:
    """Chains the assistant for k argmax drafts from the target's committed keys and values.

    Drafts are argmax (q one-hot), so sampled verification stays exact."""

    name = "assistant"

    def __init__(self, assistant: Any, target: Any) -> None:
        self.assistant, self.target = assistant, target
        model, config = target.hf.model, target.hf.config.get_text_config()
        self._embed, self._norm, self._rotary = model.embed_tokens, model.norm, model.rotary_emb
        self._stores = _store_layers(config)  # layer type -> store layer index
        if min(self._stores.values()) < 1:
            raise SpecdeckError(f"{target.name}: a store layer at index 0 reads the embeddings, "
                                "which specdeck does not capture; pick another drafter")
        self._window = int(config.sliding_window or 0)
        self._last_layer = target.n_layers - 1
        self.capture_layers = tuple(sorted({*(i - 1 for i in self._stores.values()),
                                            self._last_layer}))
        self._kv: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._state: torch.Tensor | None = None  # final-norm state before the pending token

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: Any) -> None:
        # a prompt prefix reused from the target's cache is not re-read: the assistant then
        # attends to the feed's rows only (fewer keys, still lossless)
        self._kv = dict.fromkeys(self._stores)
        self._state = None
        self.accept(feed)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self._state is None or k < 1:  # a state is set only with every layer's keys
            return Draft()
        device = self._state.device
        position = torch.tensor([[len(context) - 1]], device=device)
        shared = {kind: (keys[None], values[None]) for kind, (keys, values) in self._kv.items()}
        token = torch.tensor([[int(context[-1])]], device=device)
        state, drafted = self._state[None, None], []
        with torch.inference_mode():
            for _ in range(k):
                inputs = torch.cat([self._embed(token), state], dim=-1)
                out = self.assistant(inputs_embeds=inputs.to(self.assistant.dtype),
                                     position_ids=position, shared_kv_states=shared,
                                     use_cache=False)
                token, state = out.logits.argmax(-1), out.last_hidden_state.to(state.dtype)
                drafted.append(token)
        return Draft(tokens=tuple(int(t) for t in torch.cat(drafted, 1)[0].tolist()),
                     source=self.name)

    def accept(self, feed: StepFeed) -> None:
        hidden = feed.hidden_states
        if any(layer not in hidden for layer in self.capture_layers):
            self._state = None
            return
        positions = torch.arange(feed.start, feed.end, device=hidden[self._last_layer].device)
        with torch.inference_mode():
            for kind, index in self._stores.items():
                self._kv[kind] = self._appended(kind, *self._keys_values(
                    index, hidden[index - 1], positions))
            self._state = self._norm(hidden[self._last_layer][-1:])[0]

    def _keys_values(self, index: int, rows: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The store layer's keys and values [kv heads, rows, head dim] of rows [rows, H] at
        positions, as its attention computes them."""
        from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

        layer = self.target.layers[index]
        attention, x = layer.self_attn, layer.input_layernorm(rows[None])
        shape = (*x.shape[:-1], -1, attention.head_dim)
        keys = attention.k_proj(x).view(shape)
        values = attention.v_proj(x).view(shape) if attention.v_proj is not None else keys
        cos, sin = self._rotary(x, positions[None], attention.layer_type)
        keys = apply_rotary_pos_emb(attention.k_norm(keys), cos, sin, unsqueeze_dim=2)
        return keys.transpose(1, 2)[0], attention.v_norm(values).transpose(1, 2)[0]

    def _appended(self, kind: str, keys: torch.Tensor, values: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._kv.get(kind)
        if held is not None:
            keys, values = torch.cat([held[0], keys], 1), torch.cat([held[1], values], 1)
        if kind == "sliding_attention" and self._window:
            # twice the window: the assistant's own mask picks the last rows it reads (the
            # last window + 1 in transformers 5.25), whatever that count
            keys, values = keys[:, -2 * self._window:], values[:, -2 * self._window:]
        return keys, values


def load_assistant_drafter(target: Any, folder: str) -> AssistantDrafter:
    """The drafter over the Gemma 4 assistant in folder, for target; SpecdeckError naming
    the fix when either is not what the other needs."""
    config = target.hf.config.get_text_config()
    if getattr(config, "model_type", "") not in _TARGETS and \
            getattr(target.hf.config, "model_type", "") not in _TARGETS:
        raise SpecdeckError(f"{folder} is a Gemma 4 assistant, which drafts for Gemma 4 "
                            f"targets only, not {target.name}: pick another drafter")
    assistant = _load(folder, target)
    backbone = int(assistant.config.backbone_hidden_size)
    vocab = int(assistant.config.get_text_config().vocab_size)
    if backbone != int(config.hidden_size) or vocab != int(target.vocab_size):
        raise SpecdeckError(f"{folder} was trained for a Gemma 4 of hidden size {backbone} and "
                            f"vocabulary {vocab}; {target.name} has {config.hidden_size} and "
                            f"{target.vocab_size}: pass the assistant published with it")
    return AssistantDrafter(assistant, target)


def _load(folder: str, target: Any) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=target.hf.dtype,
                                                     use_safetensors=True)
    except (OSError, ValueError) as error:
        raise SpecdeckError(f"cannot load the assistant in {folder}: {error}") from error
    return model.to(target.device).eval()


def _store_layers(config: Any) -> dict[str, int]:
    """Per attention type, the target layer whose keys and values the assistant reads: the
    last one of that type before the target's own KV sharing starts."""
    modes = list(config.kv_sharing_modes)
    stores = {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    if not stores:
        raise SpecdeckError("the target's config names no layer that stores its keys and "
                            "values for the assistant: is it a Gemma 4?")
    return stores
