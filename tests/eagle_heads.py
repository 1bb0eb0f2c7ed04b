"""Tiny random EAGLE heads written the way each published layout stores them.

Knows: the tensor names, shapes and config keys of ../shared/docs/HEADS.md 1.1 (authors'
`midlayer.*`, SpecForge/HF `layers.0.*` with `embed_tokens` and `eagle_config` layer ids,
vLLM speculators) and 2.1 (EAGLE-1/2). Must not know: specdeck's loader (the files are
written from the spec, so the loader is tested against them, not against itself).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

LAYOUTS = ("midlayer", "layers", "speculators", "eagle1")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def write_head(folder: Path, layout: str, *, hidden: int, vocab: int, n_layers: int,
               seed: int, draft_vocab: int = 16, scale: float = 0.25) -> Path:
    """A random head for a target of this hidden size, vocabulary and layer count."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm(size: int) -> torch.Tensor:
        return 1.0 + torch.randn(size, generator=gen) * 0.1

    if layout == "eagle1":
        tensors = _eagle1_tensors(hidden, vocab, rand, norm)
        config = {**_llama_config(hidden, vocab), "bias": True,
                  "architectures": ["LlamaForCausalLM"]}
    else:
        prefix = "midlayer." if layout == "midlayer" else "layers.0."
        tensors = _eagle3_tensors(prefix, hidden, vocab, draft_vocab, seed, rand, norm)
        if layout != "midlayer":
            tensors["embed_tokens.weight"] = rand(vocab, hidden)
        config = _eagle3_config(layout, hidden, vocab, draft_vocab, n_layers)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _llama_config(hidden: int, vocab: int) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "num_hidden_layers": 1, "vocab_size": vocab,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 256}


def _eagle3_config(layout: str, hidden: int, vocab: int, draft_vocab: int,
                   n_layers: int) -> dict:
    llama = _llama_config(hidden, vocab)
    if layout == "midlayer":  # the authors' config: no layer ids, the default rule applies
        return {**llama, "architectures": ["LlamaForCausalLM"], "draft_vocab_size": draft_vocab}
    if layout == "layers":  # SpecForge: output-of-layer ids [1, N//2 - 1, N - 4]
        return {**llama, "architectures": ["LlamaForCausalLMEagle3"],
                "draft_vocab_size": draft_vocab,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                 [1, n_layers // 2 - 1, n_layers - 4],
                                 "use_aux_hidden_state": True}}
    return {  # speculators: boundary ids at the top level, the layer config nested
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0", "draft_vocab_size": draft_vocab,
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [1, 3, n_layers - 2],
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny-llama-test", "architectures":
                         ["LlamaForCausalLM"]}},
        "transformer_layer_config": {**llama, "mlp_bias": False, "attention_bias": False,
                                     "tie_word_embeddings": False, "rope_theta": 10000.0},
    }


def _eagle3_tensors(prefix: str, hidden: int, vocab: int, draft_vocab: int, seed: int,
                    rand, norm) -> dict[str, torch.Tensor]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    used = np.sort(np.random.default_rng(seed).choice(vocab, draft_vocab, replace=False))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.from_numpy(used)] = True
    return {
        "fc.weight": rand(hidden, 3 * hidden),
        f"{prefix}input_layernorm.weight": norm(hidden),
        f"{prefix}hidden_norm.weight": norm(hidden),
        f"{prefix}post_attention_layernorm.weight": norm(hidden),
        f"{prefix}self_attn.q_proj.weight": rand(q, 2 * hidden),
        f"{prefix}self_attn.k_proj.weight": rand(kv, 2 * hidden),
        f"{prefix}self_attn.v_proj.weight": rand(kv, 2 * hidden),
        f"{prefix}self_attn.o_proj.weight": rand(hidden, q),
        f"{prefix}mlp.gate_proj.weight": rand(2 * hidden, hidden),
        f"{prefix}mlp.up_proj.weight": rand(2 * hidden, hidden),
        f"{prefix}mlp.down_proj.weight": rand(hidden, 2 * hidden),
        "norm.weight": norm(hidden),
        "lm_head.weight": rand(draft_vocab, hidden) * 8,
        "d2t": torch.from_numpy(used - np.arange(draft_vocab)).long(),
        "t2d": t2d,
    }


def _eagle1_tensors(hidden: int, vocab: int, rand, norm) -> dict[str, torch.Tensor]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {
        "embed_tokens.weight": rand(vocab, hidden),
        "fc.weight": rand(hidden, 2 * hidden), "fc.bias": rand(hidden),
        "layers.0.self_attn.q_proj.weight": rand(q, hidden),
        "layers.0.self_attn.k_proj.weight": rand(kv, hidden),
        "layers.0.self_attn.v_proj.weight": rand(kv, hidden),
        "layers.0.self_attn.o_proj.weight": rand(hidden, q),
        "layers.0.mlp.gate_proj.weight": rand(2 * hidden, hidden),
        "layers.0.mlp.up_proj.weight": rand(2 * hidden, hidden),
        "layers.0.mlp.down_proj.weight": rand(hidden, 2 * hidden),
        "layers.0.post_attention_layernorm.weight": norm(hidden),
    }
