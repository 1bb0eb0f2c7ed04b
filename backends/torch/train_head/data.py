"""Self-distillation data: the target answers prompts in batches, and the same forwards capture
the three hidden states an EAGLE-3 head reads and the target's final state.

Knows: a greedy decode loop on transformers' DynamicCache that drops each finished sequence,
layer hooks, left padding, the EAGLE-3 default layers
(HEADS.md 0.1: capture-before ids [2, N//2, N-3] = the inputs of those decoder layers), the
shard files under a work folder and how to resume them. Must not know: the objective,
optimizers, prompt sources (token ids come in).

Shard `data/shard-NNNNN.safetensors`: `tokens` int32 [N] (the sequences back to back),
`offsets` int64 [n+1], `prompt_len` int32 [n], `aux` [N, 3H] and `final` [N, H] in the
target's dtype (row t: states of position t; the last token of a sequence was never fed, so
its row is zero and never read).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from backends.torch.backend import cache_kwarg

StepFn = Callable[[int, int], None]


@dataclass(frozen=True)
class Example:
    tokens: torch.Tensor      # int64 [L]
    prompt_len: int
    aux: torch.Tensor         # [L, 3H]
    final: torch.Tensor       # [L, H] post-norm final state (the target's logits input)


def capture_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default layers, capture-before: the residual stream entering these layers."""
    return (2, n_layers // 2, n_layers - 3)  # ascending and distinct from 7 layers up


def generate_examples(hf: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      eos_ids: Sequence[int], pad_id: int,
                      on_step: StepFn | None = None) -> list[Example]:
    """Greedy answers for one batch of prompts, with their captured states. A sequence leaves
    the batch the step it ends, so the forwards compute only unfinished answers (a kept row
    costs as much as a live one: 31% of the decode rows on SmolLM2's data, 64 at a time).
    `on_step(finished, written)` follows each forward: answers ended so far, tokens written."""
    layers = hf.model.layers
    ids = capture_layers(len(layers))
    step: dict[str, list[torch.Tensor]] = {str(i): [] for i in ids}
    step["final"] = []
    hooks = [layers[i].register_forward_pre_hook(_grab(step[str(i)]), with_kwargs=True)
             for i in ids]
    hooks.append(hf.model.norm.register_forward_hook(
        lambda _m, _a, out: step["final"].append(out.detach())))
    hooks += _flat_linears(hf)
    try:
        with torch.inference_mode():
            return _decode(hf, prompts, max_new_tokens, set(eos_ids), pad_id, step, ids,
                           on_step or (lambda _finished, _written: None))
    finally:
        for h in hooks:
            h.remove()


def _decode(hf: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: set[int],
            pad_id: int, step: dict[str, list[torch.Tensor]], ids: tuple[int, ...],
            on_step: StepFn) -> list[Example]:
    width = max(len(p) for p in prompts)
    device = next(hf.parameters()).device
    tokens = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    cache_arg = {cache_kwarg(hf): cache}
    alive = list(range(len(prompts)))  # original index of each batch row
    answers: list[list[int]] = [[] for _ in prompts]
    states: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    written = 0
    while alive:
        logits = hf(input_ids=tokens, attention_mask=mask, position_ids=positions,
                    use_cache=True, logits_to_keep=1, **cache_arg).logits
        aux = torch.cat([step[str(i)].pop() for i in ids], dim=-1).cpu()
        final = step["final"].pop().cpu()
        chosen = logits[:, -1].argmax(-1).tolist()
        for row, b in enumerate(alive):
            states[b].append((aux[row], final[row]))
            answers[b].append(chosen[row])
        keep = [row for row, b in enumerate(alive)
                if chosen[row] not in eos and len(answers[b]) < max_new_tokens]
        if len(keep) < len(alive):
            index = torch.tensor(keep, device=device, dtype=torch.long)
            cache.batch_select_indices(index)
            mask, positions = mask[index], positions[index]
            alive = [alive[row] for row in keep]
        written += len(chosen)
        on_step(len(prompts) - len(alive), written)
        tokens = torch.tensor([[chosen[row]] for row in keep], device=device)
        mask = torch.cat([mask, mask.new_ones((len(keep), 1))], dim=-1)
        positions = positions[:, -1:] + 1
    return [_example(list(p), answers[b], width, states[b]) for b, p in enumerate(prompts)]


def _flat_linears(hf: Any) -> list[Any]:
    """Hooks that feed every linear layer 2-D rows: for a [batch, 1, hidden] input oneDNN's
    bf16 matmul copied the weight once per sequence (a 30 GB allocation for 64 rows of the
    1.5B Qwen's output layer), then fell back to a slow batched path."""
    hooks = []
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(_flatten))
            hooks.append(module.register_forward_hook(_unflatten))
    return hooks


def _flatten(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    x = args[0]
    module._specdeck_lead = x.shape[:-1]
    return (x.reshape(-1, x.shape[-1]), *args[1:])


def _unflatten(module: Any, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
    return out.reshape(*module._specdeck_lead, out.shape[-1])


def _grab(store: list[torch.Tensor]) -> Callable[..., None]:
    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        store.append(hidden.detach())
    return hook


def _example(prompt: list[int], answer: list[int], width: int,
             states: list[tuple[torch.Tensor, torch.Tensor]]) -> Example:
    """Prompt and answer back to back; the rows of the fed tokens, then a zero row for the
    last token, which no forward saw."""
    pad = width - len(prompt)
    aux = torch.cat([a for a, _ in states])[pad:]
    final = torch.cat([f for _, f in states])[pad:]
    aux = torch.cat([aux, aux.new_zeros((1, aux.shape[-1]))])
    final = torch.cat([final, final.new_zeros((1, final.shape[-1]))])
    return Example(torch.tensor(prompt + answer, dtype=torch.long), len(prompt), aux, final)


# ---- shards on disk --------------------------------------------------------------------


def shard_path(work: Path, index: int) -> Path:
    return work / "data" / f"shard-{index:05d}.safetensors"


def save_shard(path: Path, examples: Sequence[Example]) -> None:
    lengths = [len(e.tokens) for e in examples]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)
    tensors = {"tokens": torch.cat([e.tokens for e in examples]).to(torch.int32),
               "offsets": offsets,
               "prompt_len": torch.tensor([e.prompt_len for e in examples], dtype=torch.int32),
               "aux": torch.cat([e.aux for e in examples]).contiguous(),
               "final": torch.cat([e.final for e in examples]).contiguous()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)  # a shard exists whole or not at all: an interrupted one is redone


def load_shard(path: Path) -> list[Example]:
    t = load_file(str(path))
    offsets = t["offsets"].tolist()
    return [Example(t["tokens"][a:b].to(torch.long), int(t["prompt_len"][i]),
                    t["aux"][a:b], t["final"][a:b])
            for i, (a, b) in enumerate(zip(offsets, offsets[1:]))]


def write_manifest(work: Path, data: dict[str, Any]) -> None:
    path = work / "data" / "manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def read_manifest(work: Path) -> dict[str, Any] | None:
    try:
        return json.loads((work / "data" / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
