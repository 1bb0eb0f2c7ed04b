"""Native MTP layers inside a target checkpoint, as a chain drafter with its own KV cache.

Knows: where each family keeps its MTP layer and how it fuses its inputs (HEADS.md §4):
DeepSeek-V3 and GLM-4.5 `model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.{norm, head}}`
plus a decoder layer, `eh_proj(cat(enorm(embed), hnorm(hidden)))`, embedding first; MiMo
`model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}` plus a
Qwen2 layer, `input_proj(cat(hidden_layernorm(hidden), token_layernorm(embed)))`, hidden
first; Qwen3-Next / Qwen3.5 `mtp.*` (detected; their targets keep recurrent state, refused).
Must not know: surfaces, the engine's loop.

The MTP layer reads the target's final hidden state after its final norm at position t with
the embedding of token t + 1 and predicts token t + 2. Its attention needs its own cache over
every committed position: after each verify it reads the feed's rows (the pending token's
and the accepted tokens'), each paired with the token after it. For k > 1 it runs again on
its own output after the output norm (recycled as vLLM and SGLang do) with the token it just
drafted, cycling its layers. Drafts are argmax (q one-hot), so sampled verification stays
exact. The embedding and output layer are the
target's unless the checkpoint carries its own `shared_head.head`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from app.core.protocols import StepFeed
from app.core.types import Draft, SamplingParams, SpecdeckError
from app.drafters.native import dspark_stages_refusal, has_dspark_stages, mtp_layers

_FUSE = {"deepseek": ("eh_proj", "enorm", "hnorm", "shared_head.norm"),
         "mimo": ("input_proj", "token_layernorm", "hidden_layernorm", "final_layernorm")}


@dataclass(frozen=True)
class MtpLayout:
    """Where a checkpoint keeps its MTP layers."""

    style: str  # "deepseek" (DeepSeek-V3, GLM-4.5), "mimo" or "qwen3_next" (Qwen3-Next/3.5)
    prefixes: tuple[str, ...]  # one per MTP layer, e.g. "model.layers.46."


def detect_mtp(config: dict[str, Any], keys: Sequence[str]) -> MtpLayout | None:
    """The MTP layout a config and its tensor names declare, or None (DeepSeek-V4's DSpark
    stages, also under `mtp.*`, are no MTP layers)."""
    text = config.get("text_config") or config
    count = mtp_layers(config)
    if count < 1:
        return None
    names = set(keys)
    if any(k.startswith("mtp.") for k in names):
        return MtpLayout("qwen3_next", ("mtp.",))
    if any(k.startswith("model.mtp_layers.") for k in names):
        return MtpLayout("mimo", tuple(f"model.mtp_layers.{i}." for i in range(count)))
    first = int(text["num_hidden_layers"])
    prefixes = tuple(f"model.layers.{first + i}." for i in range(count))
    if all(f"{p}eh_proj.weight" in names for p in prefixes):
        return MtpLayout("deepseek", prefixes)
    return None


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


class MtpDrafter:
    """Chains the first MTP layer for k draft tokens over its own cache (a checkpoint with
    several MTP layers drafts with the first only: the others would need caches of their own
    fed with the first one's outputs)."""

    name = "mtp"

    def __init__(self, target: Any, layers: Sequence[MtpLayer]) -> None:
        self.target, self.layer = target, layers[0]
        model = target.hf.model
        self.embed, self.norm, self.rotary = model.embed_tokens, model.norm, model.rotary_emb
        self.lm_head = target.hf.get_output_embeddings()
        self.capture_layers = (target.n_layers - 1,)
        self._cache: DynamicCache | None = None
        self._last: torch.Tensor | None = None  # out-norm state at the last committed pair

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: Any) -> None:
        # a prompt prefix the target reused from its cache is not re-read: the MTP cache
        # starts at the feed's first row (fewer keys to attend, still lossless)
        self._cache, self._last = DynamicCache(), None
        self.accept(feed)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self._last is None or k < 1:
            return Draft()
        tokens: list[int] = []
        state, length = self._last, self._cache.get_seq_length()
        position = len(context)  # the pending token's state paired with the first draft
        with torch.inference_mode():
            token = self._argmax(state)
            tokens.append(token)
            for _ in range(1, k):  # recycle the out-norm state with the token just drafted
                state = self._run(state[None], [token], position)[-1]
                position += 1
                token = self._argmax(state)
                tokens.append(token)
        extra = self._cache.get_seq_length() - length
        for layer in self._cache.layers:  # the cache keeps committed pairs only
            if extra > 0:
                layer.crop(-extra)  # transformers 5 crops by a negative count of tokens
        return Draft(tokens=tuple(tokens), source=self.name)

    def accept(self, feed: StepFeed) -> None:
        hidden = feed.hidden_states.get(self.capture_layers[0])
        if hidden is None or self._cache is None:
            self._last = None
            return
        # each row pairs with the token after it (the next token for the last row, which a
        # sampled first token need not be the argmax of); the last pair drafts the next token
        with torch.inference_mode():
            states = self.norm(hidden.to(self.lm_head.weight.dtype))
            self._last = self._run(states, feed.following, feed.start + 1)[-1]

    def _run(self, states: torch.Tensor, tokens: Sequence[int], first_position: int
             ) -> torch.Tensor:
        """The MTP layer over pairs from first_position on: state t with token t + 1 sits at
        position t + 1."""
        ids = torch.tensor(tokens, device=states.device)
        positions = torch.arange(first_position, first_position + len(tokens),
                                 device=states.device)[None]
        embeds = self.embed(ids)
        past = self._cache.get_seq_length()
        mask = torch.ones(len(tokens), past + len(tokens), dtype=torch.bool,
                          device=states.device).tril(past)[None, None]
        out = self.layer(states, embeds, attention_mask=mask, position_ids=positions,
                         cache=self._cache, use_cache=True,
                         position_embeddings=self.rotary(embeds[None], positions))
        return out

    def _argmax(self, state: torch.Tensor) -> int:
        return int((self.layer.head or self.lm_head)(state[None]).argmax(-1)[0])


# ---- loading -------------------------------------------------------------------------------


def read_layout(folder: Path) -> tuple[dict[str, Any], MtpLayout | None, list[Path]]:
    """The folder's config, MTP layout and safetensors files."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    files = sorted(folder.glob("*.safetensors"))
    keys: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys += list(f.keys())
    return config, detect_mtp(config, keys), files


def load_mtp_drafter(target: Any) -> MtpDrafter:
    """The drafter over the MTP layers of `target`'s own checkpoint; SpecdeckError naming why
    when it has none or cannot be rewound."""
    folder = getattr(target, "source", None)
    config, layout, _ = read_layout(folder) if folder is not None else ({}, None, [])
    if has_dspark_stages(config):
        raise SpecdeckError(dspark_stages_refusal(target.name, config))
    if layout is None:
        raise SpecdeckError(f"{target.name} has no native MTP layers (its config names no "
                            "num_nextn_predict_layers with MTP tensors): pick another drafter, "
                            "e.g. --drafter ngram")
    if not target.capabilities.rewind:
        raise SpecdeckError(f"{target.name} carries MTP layers but cannot speculate: "
                            f"{target.capabilities.reason}; use --drafter none")
    if layout.style not in _FUSE:
        raise SpecdeckError(f"{target.name}: MTP layout {layout.style} is not supported")
    tensors = _tensors(folder, layout)
    layers = [_build(target, layout.style, prefix, tensors) for prefix in layout.prefixes]
    return MtpDrafter(target, layers)


def _tensors(folder: Path, layout: MtpLayout) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(layout.prefixes):
                    out[key] = f.get_tensor(key)
    return out


def _build(target: Any, style: str, prefix: str, tensors: dict[str, torch.Tensor]
           ) -> MtpLayer:
    config = _sdpa_config(target.hf.config.get_text_config())
    layer_class = type(target.hf.model.layers[-1])
    index = int(re.findall(r"\d+", prefix)[-1])
    # the decoder layer of the MTP block is the target's own kind: DeepSeek-style MTP layers
    # sit at index N, past the last layer (MoE as the deeper layers are); MiMo's is a plain
    # full-attention Qwen2 layer, built as layer 0
    layer = layer_class(config, layer_idx=index if style == "deepseek" else 0)
    for module in layer.modules():  # one cache per MTP layer: its attention is layer 0 there
        if hasattr(module, "layer_idx"):
            module.layer_idx = 0
    proj, embed_norm, hidden_norm, out_norm = _FUSE[style]
    own = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    head = None
    if "shared_head.head.weight" in own:
        weight = own["shared_head.head.weight"]
        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    mtp = MtpLayer(style, config, layer, type(target.hf.model.norm), head)
    state = {"proj.weight": own[f"{proj}.weight"],
             "embed_norm.weight": own[f"{embed_norm}.weight"],
             "hidden_norm.weight": own[f"{hidden_norm}.weight"],
             "out_norm.weight": own[f"{out_norm}.weight"]}
    if head is not None:
        state["head.weight"] = own["shared_head.head.weight"]
    skip = {f"{n}.weight" for n in (proj, embed_norm, hidden_norm, out_norm)} | {
        "shared_head.head.weight", "embed_tokens.weight"}
    state.update({f"layer.{k}": v for k, v in _fuse_experts(
        {k: v for k, v in own.items() if k not in skip}).items()})
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SpecdeckError(f"{target.name}: its MTP layer {prefix} does not match a "
                            f"{layer_class.__name__} (missing {sorted(missing)[:4]}, "
                            f"unexpected {sorted(unexpected)[:4]})")
    return mtp.to(device=target.device, dtype=target.hf.dtype).eval()


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


def _sdpa_config(config: Any) -> Any:
    """A copy whose attention is plain SDPA: the drafter needs no row-exact numerics."""
    import copy

    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    return config
