"""DFlash block drafters (z-lab, arXiv 2602.06036): one forward drafts a whole block.

Knows: the z-lab checkpoint (a Qwen3 config with `block_size`, `dflash_config.{mask_token_id,
target_layer_ids}`, tensors `layers.{i}.{self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
mlp.*, input_layernorm, post_attention_layernorm}`, `fc`, `hidden_norm`, `norm`; no embedding
and no output layer: the target's are used), the forward and its own context cache (HEADS.md
§3). Must not know: surfaces, the engine's loop.

`target_layer_ids` name layer OUTPUTS (HF hidden_states[id + 1]); the torch session's capture
hooks return each layer's output, so the ids are captured as they are. The target features of
committed tokens, fused by `hidden_norm(fc(cat(...)))`, enter every draft layer only as keys
and values (the same k/v projections as the block); the block [pending, mask, ..., mask] of
k + 1 rows attends to all of them and to itself without a causal mask, and its rows 1..k,
through the target's output layer, are the k drafts (argmax: q one-hot, lossless when sampled).
The cache then keeps the context keys only. k is capped by the block size minus one.

A DFlash 2 folder (`DFlash2DraftModel`) adds convolutions around each sublayer and a candidate
selector that picks the drafts (dflash2.py); the layers, the cache and the block are the same.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from app.core.protocols import StepFeed
from app.core.types import Draft, SamplingParams, SpecdeckError
from backends.torch.heads.dflash2 import (
    CandidateSelector,
    DFlash2Config,
    GroupedCausalConv,
    add_dflash2,
    dflash2_names,
)


def default_layer_ids(n_target: int, n_draft: int) -> list[int]:
    """z-lab's rule when a checkpoint names no target layers: spread from 1 to N - 3."""
    if n_draft == 1:
        return [n_target // 2]
    return [round(1 + i * (n_target - 4) / (n_draft - 1)) for i in range(n_draft)]


class DFlashLayer(torch.nn.Module):
    """A Qwen3 decoder layer whose keys and values also cover the injected context."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        hidden, heads, kv = config.hidden_size, config.num_attention_heads, \
            config.num_key_value_heads
        self.head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.heads, self.kv_heads = heads, kv
        self.q_proj = torch.nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(hidden, kv * self.head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(hidden, kv * self.head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.attention_conv: GroupedCausalConv | None = None  # DFlash 2 sets both
        self.mlp_conv: GroupedCausalConv | None = None

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, H] block rows, ctx [C, H] new context rows; cos/sin over C + B positions.
        Returns the block's output and the keys/values of past + context + block."""
        rows = x.shape[0]
        h, kernel = _before(self.attention_conv, self.input_layernorm(x))
        q = self.q_norm(self.q_proj(h).view(rows, self.heads, self.head_dim)).transpose(0, 1)
        both = torch.cat([ctx, h])
        k = self.k_norm(self.k_proj(both).view(len(both), self.kv_heads, self.head_dim))
        v = self.v_proj(both).view(len(both), self.kv_heads, self.head_dim).transpose(0, 1)
        k = k.transpose(0, 1)
        q = q * cos[-rows:] + rotate_half(q) * sin[-rows:]
        k = k * cos + rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        group = self.heads // self.kv_heads
        attn = F.scaled_dot_product_attention(  # no mask: the block sees everything
            q[None], k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None],
            scale=self.head_dim ** -0.5)[0]
        x = x + _after(self.attention_conv, self.o_proj(attn.transpose(0, 1).reshape(rows, -1)),
                       kernel)
        h, kernel = _before(self.mlp_conv, self.post_attention_layernorm(x))
        return x + _after(self.mlp_conv, self.mlp(h), kernel), (k, v)


def _before(conv: GroupedCausalConv | None, h: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (h, None) if conv is None else conv.prepare(h)


def _after(conv: GroupedCausalConv | None, out: torch.Tensor,
           kernel: torch.Tensor | None) -> torch.Tensor:
    return out if conv is None else conv.finish(out, kernel)


class DFlashModel(torch.nn.Module):
    """The drafter's own layers: feature fusion, draft layers, final norm."""

    def __init__(self, config: Qwen3Config, n_features: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(DFlashLayer(config)
                                          for _ in range(config.num_hidden_layers))
        self.fc = torch.nn.Linear(n_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)
        self.candidate_selector: CandidateSelector | None = None  # DFlash 2 sets it

    def forward(self, features: torch.Tensor, block: torch.Tensor, first_position: int,
                cache: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """features [C, n*H] of the context rows not yet cached, block [B, H] embeddings;
        positions run from first_position over context then block."""
        ctx = self.hidden_norm(self.fc(features))
        positions = torch.arange(first_position, first_position + len(ctx) + len(block),
                                 device=block.device)[None]
        cos, sin = (t[0] for t in self.rotary(block[None], positions))  # [P, d], per head
        x, new = block, []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, ctx, cos, sin, cache[i] if cache else None)
            new.append(kv)
        return self.norm(x), new


class DFlashDrafter:
    """Drafts up to block_size - 1 tokens per step from the context features it has read."""

    name = "dflash"

    def __init__(self, target: Any, model: DFlashModel, layer_ids: Sequence[int],
                 block_size: int, mask_token_id: int, embed_scale: float = 1.0) -> None:
        self.target, self.model = target, model
        self.capture_layers = tuple(layer_ids)  # layer outputs: hidden_states[id + 1] in HF
        self.block_size, self.mask_token_id, self.embed_scale = block_size, mask_token_id, \
            embed_scale
        self.embed = target.hf.get_input_embeddings()
        self.lm_head = target.hf.get_output_embeddings()
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending: list[StepFeed] = []  # feeds whose rows the cache does not hold yet
        self._params, self._rng = SamplingParams(), np.random.default_rng()

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: Any) -> None:
        # a reused prompt prefix is not re-read: the context starts at the feed's first row
        self._cache, self._pending = [], []
        self._params, self._rng = params, rng if rng is not None else np.random.default_rng()
        self.accept(feed)

    @property
    def max_drafts(self) -> int:
        """Drafts one block gives: its rows after the pending token's."""
        return self.block_size - 1

    def propose(self, context: Sequence[int], k: int) -> Draft:
        k = min(k, self.max_drafts)
        if k < 1 or not self._pending:
            return Draft()
        start = self._pending[0].start
        features = torch.cat([self._features(feed) for feed in self._pending])
        ids = torch.tensor([int(context[-1]), *[self.mask_token_id] * (self._rows(k) - 1)],
                           device=self.embed.weight.device)
        with torch.inference_mode():
            block = self.embed(ids) * self.embed_scale
            out, kv = self.model(features.to(block.dtype), block, start, self._cache)
            draft = self._draft(out, int(context[-1]), k)
        block_rows = len(ids)  # the cache keeps the context's keys, never the block's
        self._cache = [(key[:, :-block_rows], value[:, :-block_rows]) for key, value in kv]
        self._pending = []
        return draft

    def _rows(self, k: int) -> int:
        """The block's rows for k drafts: the pending token's and k masks."""
        return k + 1

    def _draft(self, out: torch.Tensor, anchor: int, k: int) -> Draft:
        """The drafts of the block's output rows (the pending token's row is no draft)."""
        tokens, probs = self._choose(out[1:], anchor)
        return Draft(tokens=tokens, probs=probs, source=self.name)

    def accept(self, feed: StepFeed) -> None:
        # the pending token's row and the accepted drafts' rows join the context
        if all(i in feed.captured for i in self.capture_layers):
            self._pending.append(feed)

    def _choose(self, hidden: torch.Tensor, anchor: int
                ) -> tuple[tuple[int, ...], np.ndarray | None]:
        """The drafts of the slots' hidden rows: DFlash 1 takes each argmax (q one-hot);
        DFlash 2's selector walks the candidates from the anchor."""
        selector = self.model.candidate_selector
        if selector is None:
            return tuple(int(t) for t in self.lm_head(hidden).argmax(-1).tolist()), None
        return selector.walk(hidden, self.lm_head(hidden), anchor, self._params, self._rng)

    def _features(self, feed: StepFeed) -> torch.Tensor:
        return torch.cat([feed.hidden_states[i] for i in self.capture_layers], dim=-1)


# ---- loading -------------------------------------------------------------------------------


def load_dflash_drafter(target: Any, path: str) -> DFlashDrafter:
    """A z-lab DFlash (1 or 2) drafter folder, checked against the target."""
    folder = Path(path).expanduser()
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SpecdeckError(f"cannot read {folder / 'config.json'}: {error}. Give a DFlash "
                            "drafter folder (config.json and model.safetensors)") from error
    version2 = "DFlash2DraftModel" in (raw.get("architectures") or [])
    extra = raw.get("dflash_config") or {}

    def value(key: str, default: Any = None) -> Any:
        return extra.get(key, raw.get(key, default))

    config = Qwen3Config(**{k: v for k, v in raw.items() if k != "dflash_config"})
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or value("causal") or raw.get("is_causal"):
        raise SpecdeckError(f"{folder}: causal or sliding-window DFlash layers are not supported "
                            "yet; use a drafter with full attention layers")
    n_target = int(raw.get("num_target_layers") or target.n_layers)
    layer_ids = list(value("target_layer_ids") or default_layer_ids(
        n_target, config.num_hidden_layers))
    mask = value("mask_token_id")
    check_fit(folder, target, config, layer_ids, mask)
    model = DFlashModel(config, len(layer_ids))
    if version2:
        add_dflash2(model, config.vocab_size, config.hidden_size,
                    _dflash2_shape(folder, target, config, value))
    _load_weights(folder, model, version2)
    model = model.to(device=target.device, dtype=target.hf.dtype).eval()
    return DFlashDrafter(target, model, layer_ids, int(value("block_size", 16)), int(mask),
                         float(value("input_embedding_scale", 1.0)))


def read_state(folder: Path) -> tuple[list[Path], dict[str, torch.Tensor]]:
    """The folder's safetensors files and their tensors under this module's names."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return files, {_our_name(k): v for k, v in state.items()}


def _load_weights(folder: Path, model: DFlashModel, version2: bool) -> None:
    files, state = read_state(folder)
    renamed = dflash2_names(state)
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    missing = [m for m in missing if not m.startswith("rotary.")]
    if version2 and missing and files:
        raise SpecdeckError(f"{folder} is a DFlash 2 drafter without the tensors "
                            f"{sorted(missing)[:6]}: its checkpoint is incomplete")
    if missing or unexpected or not files:
        raise SpecdeckError(f"{folder} is not a DFlash drafter in the z-lab layout (missing "
                            f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")


def _our_name(key: str) -> str:
    """z-lab names -> this module's: attention projections sit beside the MLP here."""
    return key.replace(".self_attn.", ".")


def _dflash2_shape(folder: Path, target: Any, config: Qwen3Config, value: Any
                   ) -> DFlash2Config:
    try:
        shape = DFlash2Config.read(value)
    except KeyError as error:
        raise SpecdeckError(f"{folder} is a DFlash 2 drafter whose dflash_config lacks "
                            f"{error.args[0]}") from error
    if shape.group_size < 1 or config.hidden_size % shape.group_size:
        raise SpecdeckError(f"{folder}: conv_group_size {shape.group_size} does not divide "
                            f"the hidden size {config.hidden_size}")
    rows = int(target.hf.get_output_embeddings().weight.shape[0])
    if config.vocab_size < rows:  # the codebooks are indexed by the head's candidates
        raise SpecdeckError(f"{folder}: the selector's codebooks cover {config.vocab_size} "
                            f"tokens, the target's output layer {rows}: it was trained for "
                            "another target")
    return shape


def check_fit(folder: Path, target: Any, config: Qwen3Config, layer_ids: list[int],
              mask: Any) -> None:
    """SpecdeckError unless a block drafter's hidden size, mask token and target layers fit
    the target."""
    hidden = int(target.hf.config.get_text_config().hidden_size)
    if config.hidden_size != hidden:
        raise SpecdeckError(f"{folder}: this block drafter has hidden size "
                            f"{config.hidden_size}, the target {hidden}: it was trained for "
                            "another target")
    if mask is None or not 0 <= int(mask) < target.vocab_size:
        raise SpecdeckError(f"{folder}: dflash_config.mask_token_id {mask!r} is not a token of "
                            f"the target (vocabulary {target.vocab_size})")
    bad = [i for i in layer_ids if not 0 <= i < target.n_layers]
    if bad:
        raise SpecdeckError(f"{folder}: target_layer_ids {bad} are outside the target's "
                            f"{target.n_layers} layers: it was trained for another target")
