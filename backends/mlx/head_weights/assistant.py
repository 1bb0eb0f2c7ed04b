"""Gemma 4's assistant on MLX: the `gemma4_assistant` module in mlx (the math of transformers'
Gemma4AssistantForCausalLM, which mlx-lm 0.32 lacks) as the step of
backends/heads/assistant_drafter.py, the target's store layers recomputing its keys and
values, and the loader.

Knows: the assistant's tensors as transformers saves them (pre_projection, model.layers.*,
model.norm, post_projection, the output layer tied to model.embed_tokens unless lm_head is
stored, masked_embedding.* for ordered embeddings), its layers as mlx-lm's own gemma4_text
DecoderLayer built with every layer sharing keys (queries, RoPE at the given position and the
MLP are the target family's own code), its reads (one query: every full-attention row, the
last `assistant_format.sliding_read` sliding rows; no logit softcap), mlx-lm's gemma4 /
gemma4_text target (the embedding and its scale, the final norm, a store layer's projections,
norms and RoPE). Must not know: the drafting (backends/heads/assistant_drafter.py), the
pair's checks (backends/heads/assistant_format.py), the engine's loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

from app.core.types import SpecdeckError
from backends.heads.assistant_drafter import SLIDING, AssistantDrafter
from backends.heads.assistant_format import (
    check_fit,
    check_target,
    read_config,
    sliding_read,
    store_layers,
)
from backends.mlx.arrays import MlxArrays
from backends.mlx.layouts import config_fixes

# a shared layer's own key and value weights, which transformers' model ignores on load too
_UNREAD = (".self_attn.k_proj.", ".self_attn.v_proj.", ".self_attn.k_norm.",
           ".self_attn.v_norm.", "rotary_emb.")


class OrderedEmbedding(nn.Module):
    """transformers' Gemma4AssistantMaskedEmbedder: logits of the tokens of the top centroids
    only, the others one below the least of those."""

    def __init__(self, hidden: int, vocab: int, centroids: int, top_k: int) -> None:
        super().__init__()
        self.centroids = nn.Linear(hidden, centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)
        self._top_k, self._groups = top_k, centroids

    def __call__(self, h: mx.array, weight: mx.array) -> mx.array:
        """[rows, H] states and the output layer's [vocab, H] weight -> [rows, vocab]."""
        scores = self.centroids(h)
        top = mx.argpartition(-scores, kth=self._top_k - 1, axis=-1)[..., :self._top_k]
        tokens = self.token_ordering.reshape(self._groups, -1)[top].reshape(h.shape[0], -1)
        chosen = (weight[tokens] @ h[..., None])[..., 0]  # [rows, top_k * per centroid]
        floor = mx.full((h.shape[0], weight.shape[0]), chosen.min() - 1.0, dtype=h.dtype)
        return mx.put_along_axis(floor, tokens, chosen, axis=-1)


class _Body(nn.Module):
    """The assistant's `model`: its layers, final norm and (tied) embedding."""

    def __init__(self, args: gemma4_text.ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [gemma4_text.DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class AssistantNet(nn.Module):
    """pre_projection -> the shared-key layers at one position -> norm -> logits, and the
    normed state through post_projection (the next draft's input)."""

    def __init__(self, args: gemma4_text.ModelArgs, backbone: int, read: int,
                 untied: bool, ordered: OrderedEmbedding | None) -> None:
        super().__init__()
        hidden = args.hidden_size
        self.pre_projection = nn.Linear(2 * backbone, hidden, bias=False)
        self.model = _Body(args)
        self.post_projection = nn.Linear(hidden, backbone, bias=False)
        if untied:
            self.lm_head = nn.Linear(hidden, args.vocab_size, bias=False)
        if ordered is not None:
            self.masked_embedding = ordered
        self._read = read

    def __call__(self, inputs: mx.array, position: int,
                 shared: dict[str, tuple[mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
        """inputs [1, 2 * backbone] -> (logits [1, vocab], projected state [1, backbone]);
        shared: attention type -> (keys, values) [kv heads, rows, head dim]."""
        read = {kind: (keys[None], values[None]) for kind, (keys, values) in shared.items()}
        if SLIDING in read:  # one query at distance <= the window: the last rows only
            keys, values = read[SLIDING]
            read[SLIDING] = keys[:, :, -self._read:], values[:, :, -self._read:]
        h = self.pre_projection(inputs)[None]
        for layer in self.model.layers:
            h, _, _ = layer(h, None, None, shared_kv=read[layer.layer_type], offset=position)
        h = self.model.norm(h)[0]
        return self._logits(h), self.post_projection(h)

    def _logits(self, h: mx.array) -> mx.array:
        weight = self.lm_head.weight if "lm_head" in self else self.model.embed_tokens.weight
        if "masked_embedding" in self:
            return self.masked_embedding(h, weight)
        return h @ weight.T


class MlxAssistantStep:
    """The assistant and the MLX target's parts it reads."""

    def __init__(self, net: AssistantNet, body: Any) -> None:
        self._net, self._body = net, body

    def run(self, inputs: mx.array, position: int,
            shared: dict[str, tuple[mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
        return self._net(inputs, position, shared)

    def embed(self, tokens: mx.array) -> mx.array:
        # mlx-lm's gemma4_text scales its embedding in the call, not in the table
        return self._body.embed_tokens(tokens) * self._body.embed_scale

    def final_norm(self, rows: mx.array) -> mx.array:
        return self._body.norm(rows)

    def keys_values(self, index: int, rows: mx.array, first_position: int
                    ) -> tuple[mx.array, mx.array]:
        """The store layer's keys and values [kv heads, rows, head dim] of rows [rows, H] at
        positions first_position.., as its attention computes them."""
        layer = self._body.layers[index]
        attention, x = layer.self_attn, layer.input_layernorm(rows[None])
        shape = (1, rows.shape[0], attention.n_kv_heads, attention.head_dim)
        keys = attention.k_proj(x).reshape(shape)
        values = keys if attention.use_k_eq_v else attention.v_proj(x).reshape(shape)
        keys = attention.rope(attention.k_norm(keys).transpose(0, 2, 1, 3),
                              offset=first_position)
        return keys[0], attention.v_norm(values).transpose(0, 2, 1, 3)[0]


def load_assistant_drafter(target: Any, folder: str) -> AssistantDrafter:
    """The drafter over the Gemma 4 assistant in folder, for the MLX target; SpecdeckError
    naming the fix when either is not what the other needs."""
    text = getattr(target.net, "language_model", target.net)  # gemma4 wraps gemma4_text
    args = getattr(text, "args", None)
    check_target(folder, target.name, (str(getattr(target.net, "model_type", "")),
                                       str(getattr(args, "model_type", ""))))
    stores = store_layers(args, target.name)
    config = read_config(folder)
    text_config = config_fixes(config).get("text_config") or {}
    check_fit(folder, target.name, hidden=int(args.hidden_size), vocab=int(target.vocab_size),
              backbone=int(config.get("backbone_hidden_size", 1536)),
              assistant_vocab=int(text_config.get("vocab_size", 0)),
              assistant_types=text_config.get("layer_types") or (), stores=stores)
    net = _build(folder, config, text_config, target.compute_dtype)
    return AssistantDrafter(MlxAssistantStep(net, text.model), MlxArrays(target.stream),
                            stores=stores, window=int(args.sliding_window or 0),
                            last_layer=target.n_layers - 1)


def _build(folder: str, config: dict[str, Any], text_config: dict[str, Any],
           dtype: mx.Dtype) -> AssistantNet:
    weights = _tensors(folder)
    layers = int(text_config.get("num_hidden_layers", 0))
    try:  # every layer reads the target's keys, as Gemma4AssistantConfig makes them
        args = gemma4_text.ModelArgs.from_dict(text_config | {"num_kv_shared_layers": layers})
    except (TypeError, ValueError) as error:
        raise SpecdeckError(f"mlx-lm's gemma4_text cannot build the assistant in {folder}: "
                            f"{error}") from error
    ordered = None
    if config.get("use_ordered_embeddings"):
        ordered = OrderedEmbedding(args.hidden_size, args.vocab_size,
                                   int(config.get("num_centroids", 2048)),
                                   int(config.get("centroid_intermediate_top_k", 32)))
    net = AssistantNet(args, int(config.get("backbone_hidden_size", 1536)),
                       sliding_read(text_config), "lm_head.weight" in weights, ordered)
    names = {name for name, _ in tree_flatten(net.parameters())}
    missing = sorted(names - set(weights))
    if missing:
        raise SpecdeckError(f"{folder} lacks the assistant's {', '.join(missing)}: is it a "
                            "gemma4_assistant folder as transformers saves it?")
    try:
        net.load_weights([(name, weights[name]) for name in names])
    except ValueError as error:  # a tensor of another shape than the config describes
        raise SpecdeckError(f"the assistant in {folder} does not match its config: "
                            f"{error}") from error
    if ordered is not None:
        ordered.token_ordering = ordered.token_ordering.astype(mx.int32)
    net.set_dtype(dtype)
    mx.eval(net.parameters())
    return net


def _tensors(folder: str) -> dict[str, mx.array]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise SpecdeckError(f"{folder} holds no *.safetensors weights for the assistant")
    out: dict[str, mx.array] = {}
    for file in files:
        try:
            stored = mx.load(str(file))  # lazy: only the arrays taken are read
        except (OSError, RuntimeError, ValueError) as error:
            raise SpecdeckError(f"cannot read {file}: {error}") from error
        out.update({k: v for k, v in stored.items() if not any(s in k for s in _UNREAD)})
    return out
