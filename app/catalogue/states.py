"""What a hybrid target keeps per stream beside its KV cache: the recurrent state and the
conv input of each Gated DeltaNet or Mamba-2 layer, and the state slots speculation adds (one
state per verified position: state bytes x (k + 1) per stream, issue 45).

Knows: the config fields of qwen3_5 / qwen3_next (linear_*), nemotron_h (mamba_*) and
falcon_h1 (mamba_d_*) layers, and what transformers' past recording holds during a verify
(backends/torch/rewind.py): the state after each of the k + 1 rows, and k + 1 more conv input
columns. Must not know: torch, the planner's choice, surfaces (the planner and `models` are to
show it beside KV per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STATE_BYTES = 4  # transformers' recurrent rules keep their states in float32


@dataclass(frozen=True)
class LayerState:
    """One recurrent layer's per-stream state: the recurrent state's elements (float32) and
    the conv's channels and kernel width (the model's dtype)."""

    state_elements: int
    conv_channels: int
    conv_kernel: int


@dataclass(frozen=True)
class StreamState:
    """A target's recurrent layers, per stream."""

    layers: tuple[LayerState, ...]

    def bytes(self, dtype_bytes: int) -> int:
        """What one stream keeps between tokens (plain decoding)."""
        return sum(layer.state_elements * STATE_BYTES
                   + layer.conv_channels * layer.conv_kernel * dtype_bytes
                   for layer in self.layers)

    def slot_bytes(self, k: int, dtype_bytes: int) -> int:
        """What a verify of k drafts adds to one stream: k + 1 states (one slot per row) and
        k + 1 conv input columns."""
        return sum((k + 1) * (layer.state_elements * STATE_BYTES
                              + layer.conv_channels * dtype_bytes) for layer in self.layers)


def stream_state(config: dict[str, Any]) -> StreamState:
    """The recurrent layers a config declares (text_config read where it nests one); none for
    an attention-only model."""
    c = config.get("text_config") or config
    types = c.get("layer_types") or c.get("layers_block_type") or []
    if "linear_num_value_heads" in c:
        one = _delta_net(c)
        return StreamState(tuple(one for t in types if t == "linear_attention"))
    if "mamba_num_heads" in c:
        one = _mamba2(c)
        return StreamState(tuple(one for t in types if t in ("mamba", "linear_attention")))
    if "mamba_d_state" in c:  # Falcon-H1: a Mamba-2 mixer beside attention in every layer
        return StreamState((_falcon_mamba(c),) * int(c["num_hidden_layers"]))
    return StreamState(())


def _delta_net(c: dict[str, Any]) -> LayerState:
    keys = int(c["linear_num_key_heads"]) * int(c["linear_key_head_dim"])
    values = int(c["linear_num_value_heads"]) * int(c["linear_value_head_dim"])
    return LayerState(state_elements=int(c["linear_num_value_heads"])
                      * int(c["linear_key_head_dim"]) * int(c["linear_value_head_dim"]),
                      conv_channels=2 * keys + values,
                      conv_kernel=int(c.get("linear_conv_kernel_dim", 4)))


def _mamba2(c: dict[str, Any]) -> LayerState:
    inner = int(c["mamba_num_heads"]) * int(c["mamba_head_dim"])
    state = int(c["ssm_state_size"])
    return LayerState(state_elements=inner * state,
                      conv_channels=inner + 2 * int(c.get("n_groups", 1)) * state,
                      conv_kernel=int(c.get("conv_kernel", 4)))


def _falcon_mamba(c: dict[str, Any]) -> LayerState:
    inner = int(c.get("mamba_d_ssm") or int(c.get("mamba_expand", 2)) * int(c["hidden_size"]))
    state = int(c["mamba_d_state"])
    return LayerState(state_elements=inner * state,
                      conv_channels=inner + 2 * int(c.get("mamba_n_groups", 1)) * state,
                      conv_kernel=int(c.get("mamba_d_conv", 4)))
