"""Medusa heads (FasterDecoding/Medusa, arXiv 2401.10774) as a tree drafter over the target.

Knows: the published tensor names (Medusa-1 `medusa_lm_head` files: `{i}.0.linear.weight`,
`{i}.0.linear.bias`, `{i}.{L}.weight`; Medusa-2 full models: the same under `medusa_head.`),
`medusa_num_heads` / `medusa_num_layers`, the head math, a static tree of top-ranked choices,
and where the target keeps its final norm. Must not know: surfaces, the engine's loop.

Head i (0-based) reads the target's last hidden state after the final norm at position t and
predicts the token at t + 2 + i (the target's own head predicts t + 1, the pending token):
`lm_i(R^L(h))` with `R(x) = x + SiLU(W x + b)`. The reference repeats ONE ResBlock module L
times (`[ResBlock(H)] * L`), so every layer of a head shares its weights; published heads
have L = 1. There is no draft forward: each verify forward's captured last layer, at the
row of the last accepted token, gives the next tree. Drafts are each head's top-ranked
tokens, deterministic (q one-hot), so the verifier's rule for distinct deterministic
children keeps sampling exact (Medusa's own "typical acceptance" would not be lossless).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from app.core.protocols import StepFeed
from app.core.types import Draft, SamplingParams, SpecdeckError

TOP_RANKS = 4  # candidates per head the default tree draws from
TREE_NODES = 16  # default tree size: verify rows stay within the exact blocks


class MedusaHeads(torch.nn.Module):
    """n heads, each `L` applications of one shared ResBlock, then a vocabulary projection."""

    def __init__(self, n_heads: int, n_layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.n_heads, self.n_layers = n_heads, n_layers
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(n_heads))
        self.heads = torch.nn.ModuleList(torch.nn.Linear(hidden, vocab, bias=False)
                                         for _ in range(n_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] post-norm target states -> [n_heads, ..., vocab] logits."""
        out = []
        for block, head in zip(self.blocks, self.heads):
            x = hidden
            for _ in range(self.n_layers):
                x = x + torch.nn.functional.silu(block(x))
            out.append(head(x))
        return torch.stack(out)


def default_choices(n_heads: int, max_nodes: int = TREE_NODES,
                    ranks: int = TOP_RANKS) -> tuple[tuple[int, ...], ...]:
    """A static tree: paths of head ranks (rank r of head d at depth d + 1), most likely first.

    A path scores the product of 1 / (rank + 1) over its depths times 0.6 per depth (a head
    further ahead is right less often); the best max_nodes paths are taken best-first, so a
    path's parent is always in. Sorted by (length, ranks) as Medusa's choice lists are.
    """
    frontier = [(-0.6, (0,))] + [(-0.6 / (r + 1), (r,)) for r in range(1, ranks)]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < max_nodes:
        score, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < n_heads:
            for r in range(ranks):
                heapq.heappush(frontier, (score * 0.6 / (r + 1), (*path, r)))
    return tuple(sorted(chosen, key=lambda p: (len(p), p)))


class MedusaDrafter:
    """Drafts a static tree of Medusa candidates read at the last accepted row."""

    name = "medusa"

    def __init__(self, target: Any, heads: MedusaHeads,
                 choices: Sequence[tuple[int, ...]] | None = None) -> None:
        self.heads = heads
        self.norm = _final_norm(target)
        self.capture_layers = (target.n_layers - 1,)
        self.choices = tuple(choices or default_choices(heads.n_heads))
        if any(len(c) > heads.n_heads for c in self.choices):
            raise SpecdeckError(f"a Medusa tree path is deeper than the {heads.n_heads} heads")
        self._top: list[list[int]] | None = None  # per head, its tokens by rank

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: Any) -> None:
        self._read(feed)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self._top is None:
            return Draft()
        index: dict[tuple[int, ...], int] = {}
        tokens, parents = [], []
        for path in self.choices:
            if len(path) > k or path[:-1] not in index and len(path) > 1:
                continue
            index[path] = len(tokens)
            tokens.append(self._top[len(path) - 1][path[-1]])
            parents.append(index[path[:-1]] if len(path) > 1 else -1)
        return Draft(tokens=tuple(tokens), parents=tuple(parents), source=self.name)

    def accept(self, feed: StepFeed) -> None:
        self._read(feed)

    def _read(self, feed: StepFeed) -> None:
        """The next tree's candidates, from the state at the feed's last row."""
        hidden = feed.captured.get(self.capture_layers[0])
        if hidden is None:
            self._top = None
            return
        ranks = max((p[-1] for p in self.choices), default=0) + 1
        with torch.inference_mode():
            state = self.norm(hidden[feed.rows[-1]][None].to(self.heads.heads[0].weight.dtype))
            logits = self.heads(state)[:, 0]  # [n_heads, vocab]
            self._top = logits.topk(ranks, dim=-1).indices.tolist()


def _final_norm(target: Any) -> torch.nn.Module:
    """The norm the target applies before its output layer (Medusa heads read after it)."""
    norm = getattr(getattr(target.hf, "model", None), "norm", None)
    if norm is None:
        raise SpecdeckError(f"{target.name}: cannot find its final norm (model.norm), which "
                            "Medusa heads read after; use a Llama/Qwen/Mistral-style target")
    return norm


# ---- loading -------------------------------------------------------------------------------


def load_medusa(path: str | Path, hidden: int, vocab: int, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> MedusaHeads:
    """Heads from a folder (or file): safetensors with Medusa-1 or Medusa-2 names, checked
    against the target's hidden size and vocabulary."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        pt = folder / "medusa_lm_head.pt"
        hint = (f" ({pt.name} is a pickle, which specdeck never loads: save its state dict "
                "as medusa_lm_head.safetensors with safetensors.torch.save_file)"
                if pt.exists() else "")
        raise SpecdeckError(f"no Medusa heads in {path}: give a folder with safetensors "
                            f"files{hint}")
    config = _config(folder)
    layers = int(config.get("medusa_num_layers", 1))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = key.removeprefix("medusa_head.")
                if name.split(".")[0].isdigit():
                    tensors[name] = f.get_tensor(key)
    n_heads = len({k.split(".")[0] for k in tensors if k.endswith(f".{layers}.weight")})
    if n_heads == 0:
        raise SpecdeckError(f"{path} has no Medusa head tensors ('{{i}}.{layers}.weight' or "
                            f"'medusa_head.{{i}}.{layers}.weight'); is it a Medusa head?")
    heads = MedusaHeads(n_heads, layers, hidden, vocab)
    state = {}
    for i in range(n_heads):
        for ours, theirs in ((f"blocks.{i}.weight", f"{i}.0.linear.weight"),
                             (f"blocks.{i}.bias", f"{i}.0.linear.bias"),
                             (f"heads.{i}.weight", f"{i}.{layers}.weight")):
            if theirs not in tensors:
                raise SpecdeckError(f"{path}: Medusa head {i} lacks {theirs}")
            state[ours] = tensors[theirs]
    _check_shapes(path, state, hidden, vocab)
    heads.load_state_dict(state)
    return heads.to(device=device, dtype=dtype).eval()


def _config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except ValueError as error:
        raise SpecdeckError(f"cannot read {file}: {error}") from error


def _check_shapes(path: Path, state: dict[str, torch.Tensor], hidden: int, vocab: int) -> None:
    head = state["heads.0.weight"]
    if head.shape[1] != hidden:
        raise SpecdeckError(f"{path}: these Medusa heads read hidden size {head.shape[1]}, the "
                            f"target has {hidden}: they were trained for another target")
    if head.shape[0] != vocab:
        raise SpecdeckError(f"{path}: these Medusa heads predict {head.shape[0]} tokens, the "
                            f"target's vocabulary has {vocab}: they were trained for another "
                            "target")


def load_medusa_drafter(target: Any, path: str) -> MedusaDrafter:
    """The drafter for `target` from a Medusa head folder."""
    config = target.hf.config.get_text_config()
    heads = load_medusa(path, int(config.hidden_size), int(target.vocab_size),
                        dtype=target.hf.dtype, device=target.device)
    return MedusaDrafter(target, heads)
