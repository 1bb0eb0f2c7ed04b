"""Native MTP layers on MLX (inside a target checkpoint, or a Qwen3.5 / 3.6 one published
apart): the layer module, its step over an mlx-lm KVCache, and the loader
(backends/heads/mtp_drafter.py drafts with them).

Knows: the MTP layer as an mlx module (the math of backends/torch/head_weights/mtp.py) around a
decoder layer of the loaded mlx-lm model's own class (glm4_moe, deepseek_v3, mimo, qwen2,
...), built from the model's args; the model module's `sanitize`, which stacks per-expert MoE
tensors as its SwitchGLU holds them (it drops MTP layers, so their tensors are read here
from the folder's safetensors with mx.load); mlx-lm's KVCache and causal masks. Must not
know: where a family keeps its MTP layers (backends/heads/mtp_format.py, mtp_folder.py),
drafting
(backends/heads/mtp_drafter.py), the engine's loop.

Positions: the layer's RoPE offset is its cache's `offset`, so the layer sees a view of the
cache whose offset is the first new row's position (state t with token t + 1 at t + 1, as on
torch), while the keys go to the cache itself.
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

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
from backends.mlx.arrays import MlxArrays
from backends.mlx.head_weights.eagle import target_parts


class MtpLayer(nn.Module):
    """One MTP layer: two input norms, the fusing projection, a decoder layer, the out norm
    (and the checkpoint's own head when head_rows > 0)."""

    def __init__(self, style: str, hidden: int, eps: float, layer: nn.Module,
                 head_rows: int) -> None:
        super().__init__()
        self.hidden_first = style == "mimo"
        self.embed_norm, self.hidden_norm = nn.RMSNorm(hidden, eps), nn.RMSNorm(hidden, eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer
        self.out_norm = nn.RMSNorm(hidden, eps)
        if head_rows:
            self.head = nn.Linear(hidden, head_rows, bias=False)

    def __call__(self, hidden: mx.array, embeds: mx.array, mask: mx.array | None,
                 cache: Any) -> mx.array:
        """[rows, H] target states and next-token embeddings -> [rows, H] after the out norm."""
        e, h = self.embed_norm(embeds), self.hidden_norm(hidden)
        fused = mx.concatenate([h, e] if self.hidden_first else [e, h], axis=-1)
        return self.out_norm(self.layer(self.proj(fused)[None], mask, cache)[0])


class _AtPositions:
    """The cache as the layer sees it: `offset` is the new rows' first position (their RoPE
    offset); their keys and values go to the cache."""

    def __init__(self, cache: KVCache, position: int) -> None:
        self.cache, self.offset = cache, position

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.cache.update_and_fetch(keys, values)


class MlxMtpStep:
    """The MTP layer over pairs at given positions, on its own KVCache."""

    def __init__(self, layer: MtpLayer) -> None:
        self.layer = layer
        self._cache = KVCache()

    def reset(self) -> None:
        self._cache = KVCache()

    @property
    def length(self) -> int:
        return int(self._cache.offset)

    def run(self, states: mx.array, embeds: mx.array, first_position: int) -> mx.array:
        rows = states.shape[0]
        mask = create_causal_mask(rows, self.length) if rows > 1 else None
        return self.layer(states, embeds, mask, _AtPositions(self._cache, first_position))

    def trim(self, n: int) -> None:
        self._cache.trim(n)


def load_mtp_drafter(target: Any, head: str | None = None) -> MtpDrafter:
    """The drafter over the first MTP layer of the MLX target's own folder, or of the folder
    `head` (an MTP layer published apart, in place of the target's own); SpecdeckError naming
    why when there is none, it was made for another target, or mlx-lm cannot build it."""
    checkpoint = open_mtp(target) if head is None else \
        open_mtp_folder(head, target, _text_config(target.net))
    embed, final_norm, output = target_parts(target.net, target.name)
    layer = _build(target, checkpoint)
    head = layer.head if "head" in layer else output
    return MtpDrafter(MlxMtpStep(layer), MlxArrays(target.stream), embed=embed,
                      final_norm=final_norm, lm_head=head, capture_layer=target.n_layers - 1)


def _build(target: Any, checkpoint: MtpCheckpoint) -> MtpLayer:
    net, style = target.net, checkpoint.layout.style
    layer, layer_class = _decoder_layer(target, checkpoint)
    fuse, own = split_layer(_tensors(target, checkpoint), checkpoint)
    head_rows = int(fuse["head.weight"].shape[0]) if "head.weight" in fuse else 0
    args = _text_args(net)
    mtp = MtpLayer(style, int(args.hidden_size), float(args.rms_norm_eps), layer, head_rows)
    weights = fuse | {f"layer.{k}": v for k, v in _sanitized(net, own).items()}
    if style == "qwen3_next" and not checkpoint.mlx_form and _transformers_form(checkpoint):
        weights = _shifted_norms(weights)
    names = {name for name, _ in tree_flatten(mtp.parameters())}
    if names != set(weights):
        raise mismatch(target.name, checkpoint, layer_class, names - set(weights),
                       set(weights) - names)
    try:
        mtp.load_weights(list(weights.items()))
    except ValueError as error:  # a tensor of another shape than the model's args describe
        raise SpecdeckError(f"{target.name}: {checkpoint.described} does not match "
                            f"a {layer_class}: {error}") from error
    mtp.set_dtype(target.compute_dtype)
    mx.eval(mtp.parameters())
    return mtp


def _decoder_layer(target: Any, checkpoint: MtpCheckpoint) -> tuple[nn.Module, str]:
    """A fresh decoder layer of the target's own mlx-lm class, as the MTP layer's index would
    build it (DeepSeek-style MTP layers sit past the last layer: MoE where deep layers are)."""
    net = target.net
    layer_class = type(net.layers[-1])
    if getattr(layer_class, "_specdeck_hooked", False):  # a capture hook's subclass
        layer_class = layer_class.__mro__[1]
    name = f"{layer_class.__module__.rsplit('.', 1)[-1]}.{layer_class.__name__}"
    args = _text_args(net)
    try:
        if args is None:
            raise TypeError("the model keeps no args to build a layer from")
        if "layer_idx" in inspect.signature(layer_class).parameters:
            return layer_class(args, layer_idx=_layer_index(net, checkpoint)), name
        return layer_class(args), name
    except (TypeError, ValueError, AttributeError) as error:
        raise SpecdeckError(f"{target.name}: mlx-lm's {name} cannot build its MTP layer "
                            f"({error}): use --backend torch") from error


def _text_args(net: Any) -> Any:
    """The args the decoder layers are built from (a multimodal model's text model's)."""
    inner = getattr(net, "language_model", None)
    return getattr(inner, "args", None) or getattr(net, "args", None)


def _text_config(net: Any) -> dict[str, Any]:
    """The text model's args as a config's keys (mlx-lm names them as config.json does)."""
    args = _text_args(net)
    return dict(vars(args)) if args is not None else {}


def _layer_index(net: Any, checkpoint: MtpCheckpoint) -> int:
    """The index the MTP decoder layer is built as, which picks its kind: DeepSeek-style
    layers sit past the last layer; Qwen3-Next / 3.5's is full attention (the index of the
    target's first attention layer, as mlx-lm's hybrid layers read their kind off it)."""
    if checkpoint.layout.style == "deepseek":
        return checkpoint.index
    return next((i for i, layer in enumerate(net.layers)
                 if not getattr(layer, "is_linear", False)), 0)


def _transformers_form(checkpoint: MtpCheckpoint) -> bool:
    """Whether the folder holds transformers' tensors (a conv1d kernel not yet moved), whose
    Qwen3-Next / 3.5 norms scale by 1 + w: mlx-lm's own test for shifting them on load."""
    for file in checkpoint.keys:
        stored = mx.load(str(file))  # lazy: shapes only
        for key, value in stored.items():
            if "conv1d.weight" in key:
                return value.shape[-1] != 1
    return True  # mlx-lm's conversion drops mtp.*: tensors found beside it are transformers'


def _shifted_norms(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The (1 + w) norms as mlx's RMSNorm holds them (w + 1), as mlx-lm's sanitize shifts the
    target's own."""
    return {k: v + 1.0 if k.endswith(ONE_PLUS_W_NORMS) and v.ndim == 1 else v
            for k, v in weights.items()}


def _tensors(target: Any, checkpoint: MtpCheckpoint) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for file, keys in checkpoint.keys.items():
        try:
            stored = mx.load(str(file))  # lazy: only the arrays taken are read
        except (OSError, RuntimeError, ValueError) as error:
            raise SpecdeckError(f"cannot read {file}: {error}") from error
        out.update({key: stored[key] for key in keys})
    return out


def _sanitized(net: Any, own: dict[str, mx.array]) -> dict[str, mx.array]:
    """The decoder layer's stored tensors as the model's own sanitize leaves a layer's: named
    as its last layer for the call (sanitize drops MTP layers, and stacks experts only for
    the layers it has), then renamed back."""
    if not hasattr(net, "sanitize"):
        return own
    layer = f"layers.{len(net.layers) - 1}."
    sanitized = net.sanitize({f"model.{layer}{k}": v for k, v in own.items()})
    # a multimodal model's sanitize moves them under language_model.
    return {k.split(layer, 1)[1]: v for k, v in sanitized.items() if layer in k}
