"""Native MTP layers on torch (inside a target checkpoint, or a Qwen3.5 / 3.6 one published
apart): the layer module, its step over a transformers cache, and the loader
(backends/heads/mtp_drafter.py drafts with them).

Knows: the MTP layer as a torch module (two input norms, the fusing projection, a decoder
layer of the target's own class, the out norm, the checkpoint's own head when it has one),
transformers' DynamicCache and the target's rotary embedding, the fused MoE expert tensors
transformers' modules hold (and MLX's stacked ones, turned into them), torch's safetensors
reading. Must not know: where a family keeps its MTP layers (backends/heads/mtp_format.py,
mtp_folder.py), drafting (the pairs, the chain, the recycle:
backends/heads/mtp_drafter.py), surfaces, the engine's loop.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from transformers import DynamicCache

from app.core.types import SpecdeckError
from backends.heads.mtp_drafter import MtpDrafter
from backends.heads.mtp_folder import open_mtp_folder
from backends.heads.mtp_format import (
    ONE_PLUS_W_NORMS,
    MtpCheckpoint,
    mismatch,
    open_mtp,
    split_layer,
)
from backends.torch.arrays import TorchArrays


class MtpLayer(torch.nn.Module):
    """One MTP layer: two input norms, the fusing projection, a decoder layer, the out norm."""

    def __init__(self, style: str, config: Any, layer: torch.nn.Module,
                 norm_class: type, head: torch.nn.Module | None) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(getattr(config, "rms_norm_eps", 1e-6))
        self.style = style
        self.embed_norm, self.hidden_norm = norm_class(hidden, eps), norm_class(hidden, eps)
        self.proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer
        self.out_norm = norm_class(hidden, eps)
        self.head = head  # DeepSeek's shared_head.head when the checkpoint carries one

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, **layer_args: Any
                ) -> torch.Tensor:
        """[rows, H] target states and next-token embeddings -> [rows, H] after the out norm."""
        e, h = self.embed_norm(embeds), self.hidden_norm(hidden)
        fused = torch.cat([h, e] if self.style == "mimo" else [e, h], dim=-1)
        x = self.layer(self.proj(fused)[None], **layer_args)
        return self.out_norm((x[0] if isinstance(x, tuple) else x)[0])


class TorchMtpStep:
    """The MTP layer over pairs at given positions, on its own DynamicCache."""

    def __init__(self, layer: MtpLayer, rotary: torch.nn.Module) -> None:
        self.layer, self.rotary = layer, rotary
        self._cache = DynamicCache()

    def reset(self) -> None:
        self._cache = DynamicCache()

    @property
    def length(self) -> int:
        return self._cache.get_seq_length()

    def run(self, states: torch.Tensor, embeds: torch.Tensor, first_position: int
            ) -> torch.Tensor:
        rows, past = states.shape[0], self.length
        positions = torch.arange(first_position, first_position + rows,
                                 device=states.device)[None]
        mask = torch.ones(rows, past + rows, dtype=torch.bool,
                          device=states.device).tril(past)[None, None]
        return self.layer(states, embeds, attention_mask=mask, position_ids=positions,
                          cache=self._cache, use_cache=True,
                          position_embeddings=self.rotary(embeds[None], positions))

    def trim(self, n: int) -> None:
        for layer in self._cache.layers:
            if n > 0:
                layer.crop(-n)  # transformers 5 crops by a negative count of tokens


def load_mtp_drafter(target: Any, head: str | None = None) -> MtpDrafter:
    """The drafter over the first MTP layer of `target`'s own checkpoint, or of the folder
    `head` (an MTP layer published apart, in place of the target's own); SpecdeckError
    naming why when there is none, it was made for another target, or the target cannot be
    rewound."""
    checkpoint = open_mtp(target) if head is None else \
        open_mtp_folder(head, target, target.hf.config.get_text_config().to_dict())
    layer = _build(target, checkpoint, _tensors(checkpoint))
    model, output = target.hf.model, target.hf.get_output_embeddings()
    dtype = output.weight.dtype
    return MtpDrafter(TorchMtpStep(layer, model.rotary_emb), TorchArrays(output.weight.device),
                      embed=model.embed_tokens, final_norm=lambda h: model.norm(h.to(dtype)),
                      lm_head=layer.head or output, capture_layer=target.n_layers - 1)


def _tensors(checkpoint: MtpCheckpoint) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file, keys in checkpoint.keys.items():
        with safe_open(str(file), framework="pt") as f:
            out.update({key: f.get_tensor(key) for key in keys})
    return out


def _build(target: Any, checkpoint: MtpCheckpoint, tensors: dict[str, torch.Tensor]
           ) -> MtpLayer:
    config = _sdpa_config(target.hf.config.get_text_config())
    layer_class = type(target.hf.model.layers[-1])
    style = checkpoint.layout.style
    layer = layer_class(config, layer_idx=_layer_index(config, checkpoint))
    for module in layer.modules():  # one cache per MTP layer: its attention is layer 0 there
        if hasattr(module, "layer_idx"):
            module.layer_idx = 0
    fuse, own = split_layer(tensors, checkpoint)
    head = None
    if "head.weight" in fuse:
        rows, hidden = fuse["head.weight"].shape
        head = torch.nn.Linear(hidden, rows, bias=False)
    mtp = MtpLayer(style, config, layer, type(target.hf.model.norm), head)
    state = fuse | {f"layer.{k}": v for k, v in _fuse_experts(own).items()}
    if checkpoint.mlx_form:
        state = _from_mlx_form(state)
    try:
        missing, unexpected = mtp.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a tensor of another shape than the target's layer holds
        raise SpecdeckError(f"{target.name}: {checkpoint.described} does not match a "
                            f"{layer_class.__name__}: {error}") from error
    if missing or unexpected:
        raise mismatch(target.name, checkpoint, layer_class.__name__, missing, unexpected)
    return mtp.to(device=target.device, dtype=target.hf.dtype).eval()


def _layer_index(config: Any, checkpoint: MtpCheckpoint) -> int:
    """The index the MTP decoder layer is built as, which picks its kind: DeepSeek-style MTP
    layers sit at N, past the last layer (MoE as the deeper layers are); MiMo's is a plain
    full-attention Qwen2 layer (0); Qwen3-Next / 3.5's is full attention (the first such
    index, where a hybrid target's layer types say which kind a layer is)."""
    if checkpoint.layout.style == "deepseek":
        return checkpoint.index
    types = list(getattr(config, "layer_types", None) or ())
    return types.index("full_attention") if "full_attention" in types else 0


def _fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names (`mlp.experts.{j}.{gate,up,down}_proj.weight`) as the
    fused tensors transformers' MoE modules hold: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    experts = sorted({int(m[1]) for k in state if (m := re.match(r"mlp\.experts\.(\d+)\.", k))})
    if not experts:
        return state
    out = {k: v for k, v in state.items() if not k.startswith("mlp.experts.")}
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [state[f"mlp.experts.{j}.gate_proj.weight"], state[f"mlp.experts.{j}.up_proj.weight"]])
        for j in experts])
    out["mlp.experts.down_proj"] = torch.stack([state[f"mlp.experts.{j}.down_proj.weight"]
                                                for j in experts])
    return out


def _from_mlx_form(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MLX's tensors as transformers' modules hold them: the (1 + w) norms back to w (in
    float32: the stored w + 1 already rounded w), stacked experts `switch_mlp.{gate,up,down}
    _proj` [E, I, H] / [E, H, I] as the fused gate_up_proj [E, 2I, H] and down_proj."""
    out = {k: v.float() - 1.0 if k.endswith(ONE_PLUS_W_NORMS) and v.ndim == 1 else v
           for k, v in state.items()}
    stacked = "layer.mlp.switch_mlp."
    if f"{stacked}gate_proj.weight" in out:
        gate, up, down = (out.pop(f"{stacked}{name}_proj.weight") for name in ("gate", "up",
                                                                                "down"))
        out["layer.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out["layer.mlp.experts.down_proj"] = down
    return out


def _sdpa_config(config: Any) -> Any:
    """A copy whose attention is plain SDPA: the drafter needs no row-exact numerics."""
    import copy

    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    return config
