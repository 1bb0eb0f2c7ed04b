"""EAGLE heads as torch modules: EAGLE-3 (`Eagle3Head`) and EAGLE-1/2 (`Eagle1Head`), with
their loader (`load_eagle_head`) and the EAGLE-3 writer (`save_eagle3`).

Knows: the forward pass of one draft step of each head, exactly as ../shared/docs/HEADS.md
1.2 and 2.1 give it (embedding first, then the hidden state; RMSNorm in fp32; softmax in fp32;
the head's own RoPE), the draft-vocabulary map (d2t offsets), safetensors I/O. Must not know:
the engine, drafting policy (chains, trees, sampling: backends/heads/eagle_drafter.py),
the target model beyond the sizes it is checked against.

Stable API (train-head builds on it):
- `Eagle3Head(spec)`; `head.project(states)` = fc over the captured target states (a list of
  [..., Ht] tensors in ascending layer order) -> [..., H]; `head(embeds, hidden, positions,
  past=None, mask=None)` -> (h, present) where h is the pre-norm output [B, T, H] and present
  the layer's (k, v) after this call (past concatenated); `head.logits(h)` -> draft-vocab
  logits; `head.feedback(h)` -> what step j+1 reads as hidden; `head.to_target(ids)` maps
  draft ids to target ids; `head.own_embedding()` -> its embedding, or None (the target's).
- `new_eagle3_spec(...)` builds the EagleSpec of a fresh head; `save_eagle3(head, folder)`
  writes the authors' layout (`midlayer.*`, config.json) that vLLM and SGLang load.
- `load_eagle_head(path, ...)` -> (head, spec) for any published layout, checked against the
  target.

mask: bool [T, past + T] (True = may attend), shared by the batch; None = causal over the new
rows with every past key visible.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.activations import ACT2FN

from app.core.types import SpecdeckError
from backends.heads.eagle_format import (
    EagleSpec,
    check_vocab_map,
    checked_spec,
    module_name,
)

KV = tuple[torch.Tensor, torch.Tensor]  # [B, kv_heads, keys, head_dim] each, keys after RoPE


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rope(nn.Module):
    """The head's own rotary embedding (its rope_parameters, not the target's)."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        rope_type = spec.rope.get("rope_type", "default")
        self.scale = 1.0
        if rope_type == "default":
            dims = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float()
            inv_freq = 1.0 / (spec.rope["rope_theta"] ** (dims / spec.head_dim))
        else:
            inv_freq, self.scale = _scaled_inv_freq(spec)
        # an attribute, not a buffer: module.to(bfloat16) must not round the frequencies
        self.inv_freq = inv_freq.float()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, head_dim] for positions [B, T]."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def _scaled_inv_freq(spec: EagleSpec) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = spec.rope["rope_type"]
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise SpecdeckError(f"{spec.name} asks for RoPE type {rope_type!r}, which this "
                            f"transformers does not know: upgrade transformers")
    config = LlamaConfig(hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
                         head_dim=spec.head_dim, rope_parameters=dict(spec.rope),
                         max_position_embeddings=spec.max_position_embeddings)
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq, float(scale)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HeadAttention(nn.Module):
    """Attention over the head's KV cache; in_features is 2H for EAGLE-3's layer 0."""

    def __init__(self, spec: EagleSpec, in_features: int) -> None:
        super().__init__()
        qkv_bias = spec.attention_bias or spec.qkv_bias
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, spec.hidden_size,
                                bias=spec.attention_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                past: KV | None, mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        batch, rows, _ = x.shape
        q = self.q_proj(x).view(batch, rows, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch, rows, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, rows, self.kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        group = self.heads // self.kv_heads
        # torch's fused attention accumulates in fp32 whatever the inputs: the head reading a
        # 700-token prompt took 472 ms in bf16 matmuls on a CPU without native bf16, 16 here
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
            attn_mask=_allowed(mask, rows, k.shape[2], x.device))
        return self.o_proj(out.transpose(1, 2).reshape(batch, rows, -1)), (k, v)


def _allowed(mask: torch.Tensor | None, rows: int, keys: int, device: Any) -> torch.Tensor:
    """The bool mask [rows, keys] a row attends through (causal after the past, when None)."""
    if mask is not None:
        return mask
    allowed = torch.ones(rows, keys, dtype=torch.bool, device=device)
    allowed[:, keys - rows:] = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    return allowed


class HeadMLP(nn.Module):
    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.act = ACT2FN[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads cat(input_layernorm(embed), hidden_norm(g))."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        self.norm_before_residual = spec.norm_before_residual
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = HeadAttention(spec, 2 * spec.hidden_size)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = HeadMLP(spec)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], past: KV | None,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        attn, present = self.self_attn(x, rope, past, mask)
        h = residual + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, present


class Eagle3Head(nn.Module):
    """One EAGLE-3 head; parameter names are the authors' (`midlayer.*`)."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        self.spec = spec
        width = spec.n_features * spec.target_hidden_size
        if spec.norm_before_fc:
            self.input_norm = RMSNorm(width, spec.rms_norm_eps)
        if spec.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(spec.target_hidden_size, spec.rms_norm_eps)
                                         for _ in range(spec.n_features))
        self.fc = nn.Linear(width, spec.hidden_size, bias=spec.fc_bias)
        self.midlayer = Eagle3Layer(spec)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
        self.embed_tokens = (nn.Embedding(spec.vocab_size, spec.hidden_size)
                             if spec.own_embed else None)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(spec.vocab_size, dtype=torch.bool)
                             if spec.draft_vocab_size == spec.vocab_size
                             else torch.zeros(spec.vocab_size, dtype=torch.bool))
        self.rope = Rope(spec)

    def project(self, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """fc over the target's captured states, ascending layer order."""
        if hasattr(self, "fc_norm"):
            states = [norm(s) for norm, s in zip(self.fc_norm, states)]
        x = torch.cat(list(states), dim=-1)
        if hasattr(self, "input_norm"):
            x = self.input_norm(x)
        return self.fc(x)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                past: Sequence[KV] | None = None, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[KV]]:
        rope = self.rope(positions, embeds.dtype)
        h, present = self.midlayer(embeds, hidden, rope, past[0] if past else None, mask)
        return h, [present]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def get_output_embeddings(self) -> nn.Module:
        """The draft-vocabulary output layer (what backends/torch/quant.py keeps int8)."""
        return self.lm_head

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden state step j+1 reads: pre-norm, or post-norm for EAGLE 3.1 heads."""
        return self.norm(h) if self.spec.norm_output else h

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def own_embedding(self) -> nn.Module | None:
        return self.embed_tokens


class Eagle1Layer(nn.Module):
    """A Llama decoder layer; EAGLE-1's layer 0 has no input norm (fc output goes straight in)."""

    def __init__(self, spec: EagleSpec, index: int) -> None:
        super().__init__()
        if index:
            self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = HeadAttention(spec, spec.hidden_size)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = HeadMLP(spec)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                past: KV | None, mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        normed = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        attn, present = self.self_attn(normed, rope, past, mask)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), present


class Eagle1Head(nn.Module):
    """An EAGLE-1/2 head: fc(cat(embed, feature)) -> decoder layer(s); logits come from the
    target's own output layer, applied by the caller (`logits` needs it)."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        self.spec = spec
        self.fc = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=spec.fc_bias)
        self.layers = nn.ModuleList(Eagle1Layer(spec, i) for i in range(spec.n_layers))
        self.embed_tokens = (nn.Embedding(spec.vocab_size, spec.hidden_size)
                             if spec.own_embed else None)
        self.rope = Rope(spec)
        self.target_head: Any = None  # the target's output layer: use_target_head

    def use_target_head(self, head: nn.Module) -> None:
        """Read logits through the target's output layer, without adopting it as a submodule
        (the head's state dict, dtype and device stay its own)."""
        object.__setattr__(self, "target_head", head)

    def get_output_embeddings(self) -> None:
        return None  # logits come from the target's layer

    def project(self, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's final post-norm state is the feature as it is."""
        return states[-1]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                past: Sequence[KV] | None = None, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[KV]]:
        rope = self.rope(positions, embeds.dtype)
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        present = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, rope, past[i] if past else None, mask)
            present.append(kv)
        return x, present

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.target_head(h)

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def own_embedding(self) -> nn.Module | None:
        return self.embed_tokens


def load_eagle_head(path: str | Path, *, kind: str, target_name: str, hidden_size: int,
                    vocab_size: int, n_layers: int, dtype: torch.dtype = torch.float32,
                    device: str = "cpu") -> tuple[nn.Module, EagleSpec]:
    """A head folder in any published layout as (module, spec), refused when it is not `kind`
    ("eagle3" or "eagle") or was built for another target (both named)."""
    spec = checked_spec(path, kind=kind, target_name=target_name, hidden_size=hidden_size,
                        vocab_size=vocab_size, n_layers=n_layers)
    head: nn.Module = Eagle3Head(spec) if kind == "eagle3" else Eagle1Head(spec)
    state = {renamed: tensor for name, tensor in load_file(spec.weights).items()
             if (renamed := module_name(name, spec)) is not None}
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in ("d2t", "t2d")]
    if missing or unexpected:
        raise SpecdeckError(f"{spec.name}'s tensors do not match its config: missing "
                            f"{sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}")
    if kind == "eagle3":
        _check_vocab_map(head, spec)
    return head.to(device=device, dtype=dtype).eval(), spec


def _check_vocab_map(head: Eagle3Head, spec: EagleSpec) -> None:
    ids = head.to_target(torch.arange(spec.draft_vocab_size))
    check_vocab_map(spec, int(ids.min()), int(ids.max()), int(head.t2d.sum()))


def new_eagle3_spec(name: str, *, target_hidden_size: int, vocab_size: int,
                    draft_vocab_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    intermediate_size: int, rms_norm_eps: float = 1e-6,
                    rope_theta: float = 10000.0, max_position_embeddings: int = 2048,
                    hidden_size: int | None = None, layer_ids: tuple[int, ...] | None = None,
                    own_embed: bool = False) -> EagleSpec:
    """The spec of a fresh EAGLE-3 head (authors' layout). layer_ids: capture-before hidden
    state ids; None = the default rule [2, N//2, N-3]."""
    return EagleSpec(
        kind="eagle3", layout="midlayer", name=name,
        hidden_size=hidden_size or target_hidden_size, target_hidden_size=target_hidden_size,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, rms_norm_eps=rms_norm_eps, hidden_act="silu",
        vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope={"rope_type": "default", "rope_theta": float(rope_theta)},
        layer_ids=layer_ids, own_embed=own_embed)


def eagle3_config(spec: EagleSpec) -> dict[str, Any]:
    """config.json of the authors' layout. Layer ids, when not the default rule, are written
    in SpecForge's output-of-layer convention (id - 1) under eagle_config, which SGLang reads
    as such; vLLM reads those ids as boundaries, so heads on default layers write none."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "num_hidden_layers": 1, "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": spec.hidden_act, "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope.get("rope_theta", 10000.0), "tie_word_embeddings": False,
        "attention_bias": spec.attention_bias,
    }
    if spec.target_hidden_size != spec.hidden_size:
        config["target_hidden_size"] = spec.target_hidden_size
    if spec.layer_ids:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": _written_ids(spec)}
    return config


def _written_ids(spec: EagleSpec) -> list[int]:
    """Ids that read back to the same layers under read_eagle_spec's rule (and SGLang PR
    #25454's): output-of-layer ids when the first is below 2, boundary ids otherwise."""
    boundary = sorted(i + 1 if spec.ids_add_one else i for i in (spec.layer_ids or ()))
    return [i - 1 for i in boundary] if boundary[0] - 1 < 2 else boundary


def save_eagle3(head: Eagle3Head, folder: str | Path) -> Path:
    """Write the head in the authors' layout: config.json + model.safetensors (midlayer.*)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if head.spec.draft_vocab_size == head.spec.vocab_size:
        state.pop("d2t"), state.pop("t2d")  # identity maps are left out, as the authors do
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(eagle3_config(head.spec), indent=2))
    return folder
