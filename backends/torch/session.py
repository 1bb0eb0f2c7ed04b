"""Sessions over a loaded torch model: one KV cache each; a forward appends a chain or a tree,
keep and rewind cut it back. Two cache strategies: LeanSession (the lean CPU forward on a
static cache, decoder.py) and HfSession (transformers' forward on a DynamicCache).

Knows: the verify block split and the padding that keep rows exact (shared by both), the
lean decoder's call, transformers' forward, mask and cache layout, forward hooks for
hidden-state capture, a session's own output layer (output_heads.py). Must not know:
loading, dtypes, quantizing (backend.py), drafting or verification rules (app/).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer

from app.core.protocols import Capabilities, ForwardCall, TargetOutput
from app.core.types import SpecdeckError, tree_parents
from backends.torch import attention as torch_attention
from backends.torch.decoder import LeanDecoder, Segment
from backends.torch.output_heads import SubsetHead, logits_are_the_head_alone
from backends.torch.rewind import PastRecorder, recorder_for
from backends.torch.static_kv import chain_keys, tree_keys, tree_positions

# forwards up to this many rows are verifies (split into exact blocks); longer ones are prompt
# prefills, split alike on the CPU and run in one call on a GPU
MAX_VERIFY_ROWS = torch_attention.MAX_ROWWISE_ROWS

Hidden = dict[int, torch.Tensor]  # captured layer -> its outputs [rows, hidden]


class SessionModel(Protocol):
    """What a session reads of its model (backend.TorchModel)."""

    name: str
    device: str
    hf: Any
    layers: Any
    n_layers: int
    lean: LeanDecoder | None
    context_length: int
    vocab_size: int
    min_rows: int
    row_block: int
    cache_kwarg: str
    capabilities: Capabilities

    @property
    def drafting_head(self) -> torch.nn.Module | None: ...


@dataclass(frozen=True)
class Block:
    """Rows start..end of one forward, as a cache strategy runs them."""

    ids: tuple[int, ...]  # the real rows, then `pad` copies of the last
    base: int  # the cache slot of the forward's first row
    start: int
    end: int
    pad: int
    tree: tuple[int, ...] | None  # the whole forward's parents; None for a chain
    n_logits: int  # logits of the last rows, padding rows included
    rows: int = 0  # the whole forward's real rows


class TorchSession(ABC):
    """The rules both cache strategies share: token ids, verify blocks, padding, capture
    bookkeeping and the session's own output layer.

    Exact sessions (the target's) split a verify forward into blocks of `model.row_block`
    rows, the sizes whose matmuls the load-time check found to give each row the bits it gets
    alone, and pad a block to `min_rows`; attention is row-wise (backends/torch/attention.py).
    """

    def __init__(self, model: SessionModel, capture_layers: Sequence[int], exact: bool) -> None:
        self._model = model
        self.exact = exact
        self.min_rows = model.min_rows if exact else 1
        self._ids: list[int] = []
        self._capture = tuple(capture_layers)  # captured on every forward
        self._light: torch.nn.Module | None = None
        self._subset: SubsetHead | None = None

    @property
    @abstractmethod
    def length(self) -> int: ...

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._ids)

    @property
    def head(self) -> torch.nn.Module | None:
        """The output layer of this session's own, None while it computes with the model's."""
        return self._subset if self._subset is not None else self._light

    def restrict_vocab(self, token_ids: Sequence[int] | None) -> None:
        """Compute logits only for token_ids (others read -inf); None: the whole vocabulary.

        For drafters: the output layer is a large share of a small model's weights (136M of
        the 0.5B Qwen's 494M), and a drafter that never proposes rare tokens loses little.
        The rows are cut from the model's own output layer, which stays as it is.
        """
        if token_ids is None or not self._may_own_head():
            self._subset = None
            return
        self._subset = SubsetHead(self._model.hf.get_output_embeddings(), token_ids,
                                  self._model.vocab_size)

    def lighten_head(self) -> None:
        """Draft through the model's 4-bit drafting head (w4a8 models; others keep theirs)."""
        if self._may_own_head():
            self._light = self._model.drafting_head

    def _may_own_head(self) -> bool:
        return True

    def forward(self, token_ids: Sequence[int], n_logits: int = 1,
                parents: Sequence[int] | None = None,
                capture: Sequence[int] = ()) -> TargetOutput:
        real = [int(t) for t in token_ids]
        tree = _tree_rows(parents, len(real))
        if tree is not None and not self._model.capabilities.tree_attention:
            raise SpecdeckError(f"{self._model.name} cannot verify trees: "
                                f"{self._model.capabilities.reason}")
        want = self._wanted(capture)
        base = self.length
        block = self._rows_per_block(len(real))
        first_logit = len(real) - n_logits
        parts, captured = [], {i: [] for i in want}
        for start in range(0, len(real), block):
            end = min(start + block, len(real))
            logits, hidden = self._block(real, start, end, base, tree, first_logit, want)
            parts.append(logits)
            for layer in want:
                captured[layer].append(hidden[layer])
        return self._appended(real, parts, captured)

    def _appended(self, real: list[int], parts: list[torch.Tensor],
                  captured: dict[int, list[torch.Tensor]]) -> TargetOutput:
        """The forward's output from its blocks' logits and captures; its ids join the
        session's."""
        self._ids.extend(real)
        logits = torch.cat([p for p in parts if p.shape[0]])  # [n_logits, vocab]
        argmax = tuple(logits.argmax(dim=-1).tolist())
        return TargetOutput(argmax=argmax, logits_fn=lambda: logits.float().cpu().numpy(),
                            hidden_states={i: torch.cat(h) for i, h in captured.items()})

    def _rows_per_block(self, rows: int) -> int:
        """Rows per forward call. An exact CPU session runs every forward, prompts included,
        in the exact blocks: a row then gets the same bits whether it came in a prompt, a
        verify or alone, so what the cache held before never changes an answer (a prompt
        sent twice found all but its last token cached and computed that one alone, unlike
        its first, batched prefill). Elsewhere prompts run in one call."""
        if self.exact and (rows <= MAX_VERIFY_ROWS or self._model.device == "cpu"):
            return self._model.row_block
        return rows

    def _wanted(self, capture: Sequence[int]) -> frozenset[int]:
        """The layers this forward captures: the session's own and the forward's."""
        want = frozenset((*self._capture, *capture))
        bad = [i for i in want if not 0 <= i < self._model.n_layers]
        if bad:
            raise SpecdeckError(f"{self._model.name} has {self._model.n_layers} layers; "
                                f"cannot capture {sorted(bad)}")
        return want

    def _block(self, real: list[int], start: int, end: int, base: int,
               tree: tuple[int, ...] | None, first_logit: int,
               want: frozenset[int]) -> tuple[torch.Tensor, Hidden]:
        """Rows start..end of a forward: the logits of those among the last n_logits, and the
        captured layers' outputs for the real rows."""
        rows = real[start:end]
        # padding rows sit after the real ones: causal attention keeps them invisible
        pad = max(self.min_rows - len(rows), 0)
        keep = max(end - max(start, first_logit), 0)
        logits, hidden = self._run(Block(tuple(rows + rows[-1:] * pad), base, start, end, pad,
                                         tree, keep + pad, len(real)), want)
        if pad:
            self._crop(self.length - pad)
        return logits[:keep], {i: out[:len(rows)] for i, out in hidden.items()}

    @abstractmethod
    def _run(self, block: Block, want: frozenset[int]) -> tuple[torch.Tensor, Hidden]:
        """Append the block's rows to the cache: logits [n_logits, vocab], the wanted layers'
        outputs for every row."""

    def keep(self, length: int, rows: Sequence[int]) -> None:
        rows = list(rows)
        if rows == list(range(len(rows))):
            self.rewind(length + len(rows))
            return
        self._select(length, rows)
        self._ids[length:] = [self._ids[length + r] for r in rows]

    @abstractmethod
    def _select(self, length: int, rows: list[int]) -> None:
        """Keep the first `length` cached tokens, then those at length + r for r in rows."""

    def rewind(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} tokens to {length}")
        self._crop(length)
        del self._ids[length:]

    @abstractmethod
    def _crop(self, length: int) -> None:
        """Cut the cache (not the ids) to at most `length` tokens."""

    @abstractmethod
    def _reset(self) -> None:
        """An empty cache in place of this session's."""

    def _replay(self, length: int) -> None:
        """The cache of the first `length` tokens, computed again: what it kept does not
        reach that far back (a new prompt sharing an older prefix). The ids stay as they
        were."""
        ids, self._ids = self._ids, []
        self._reset()
        try:
            if length:
                self.forward(ids[:length], n_logits=1)
        finally:
            self._ids = ids


class LeanSession(TorchSession):
    """A session on the model's LeanDecoder and a static cache; the decoder hands captured
    layers over itself, so nothing is hooked."""

    def __init__(self, model: SessionModel, capture_layers: Sequence[int], exact: bool) -> None:
        super().__init__(model, capture_layers, exact)
        if model.lean is None:
            raise ValueError(f"{model.name} has no lean forward: use HfSession")
        self._lean = model.lean
        self._static = self._lean.new_cache(model.context_length)

    @property
    def length(self) -> int:
        return self._static.length

    def _may_own_head(self) -> bool:
        # a capped model's (Gemma 4's) logits are not its head's alone: the lean forward caps
        # only what the model's own head computes, as HfSession keeps the model's
        return logits_are_the_head_alone(self._model.hf.config)

    def _run(self, block: Block, want: frozenset[int]) -> tuple[torch.Tensor, Hidden]:
        return self._lean.forward_segments([self.segment(block)], want, head=self.head)[0]

    def segment(self, block: Block) -> Segment:
        """The block's rows on this session's cache, with their positions and visible slots."""
        first, n = self._static.length, len(block.ids)
        if block.tree is None:
            positions, keys = list(range(first, first + n)), chain_keys(first, n)
        else:
            positions = tree_positions(block.tree, block.base, block.start, block.end, block.pad)
            keys = tree_keys(block.tree, block.base, block.start, block.end, block.pad)
        return Segment(self._static, block.ids, tuple(positions), keys, block.n_logits)

    def _select(self, length: int, rows: list[int]) -> None:
        self._static.select(length, [length + r for r in rows])

    def _crop(self, length: int) -> None:
        if length < self._static.length and not self._static.reaches(length):
            self._replay(length)  # a sliding window let go of what that row would see
            return
        self._static.length = min(self._static.length, length)

    def _reset(self) -> None:
        self._static = self._lean.new_cache(self._model.context_length)


class HfSession(TorchSession):
    """A session on transformers' forward and a DynamicCache (GPUs, and models the lean
    forward does not compute). Layers are hooked only while a capturing forward runs. Where
    the cache keeps a sliding window or a recurrent state, its past is recorded (rewind.py)
    so verify rows can be cut back; a rewind below what was recorded replays the tokens."""

    def __init__(self, model: SessionModel, capture_layers: Sequence[int], exact: bool) -> None:
        super().__init__(model, capture_layers, exact)
        self._cache, self._past = self._new_cache()

    def _new_cache(self) -> tuple[DynamicCache, PastRecorder | None]:
        cache = DynamicCache(config=self._model.hf.config)
        return cache, recorder_for(cache)

    @property
    def length(self) -> int:
        return self._past.length if self._past else self._cache.get_seq_length()

    def _may_own_head(self) -> bool:
        return logits_are_the_head_alone(self._model.hf.config)

    def _run(self, block: Block, want: frozenset[int]) -> tuple[torch.Tensor, Hidden]:
        device = self._model.device
        if self._past is not None:
            self._past.prepare(self.length, len(block.ids), block.rows, block.end == block.rows)
        ids = torch.tensor([list(block.ids)], dtype=torch.long, device=device)
        extra = {} if block.tree is None else _tree_inputs(block.tree, block.base, block.start,
                                                            block.end, block.pad, device)
        hidden: Hidden = {}
        # removed by handle whatever the forward raises: a hook left on the shared layers would
        # keep this session alive and run on every later forward of the model
        handles = [self._model.layers[i].register_forward_hook(_recorder(hidden, i))
                   for i in sorted(want)]
        try:
            with torch.inference_mode():
                return self._logits(ids, extra, block.n_logits), hidden
        finally:
            for handle in handles:
                handle.remove()

    def _logits(self, ids: torch.Tensor, extra: dict[str, torch.Tensor],
                n_logits: int) -> torch.Tensor:
        cache = {self._model.cache_kwarg: self._cache}
        head = self.head
        if head is None:
            return self._model.hf(input_ids=ids, use_cache=True, logits_to_keep=n_logits,
                                  **extra, **cache).logits[0]
        # the base model's last hidden state through the session's own output layer: what
        # the model's forward computes with its own (logits_are_the_head_alone)
        states = self._model.hf.model(input_ids=ids, use_cache=True, **extra,
                                      **cache).last_hidden_state[0]
        return head(states[states.shape[0] - n_logits:])

    def _select(self, length: int, rows: list[int]) -> None:
        if self._past is not None:  # capabilities refuse trees on these targets first
            raise SpecdeckError(f"{self._model.name} keeps one window or state per token: "
                                "it keeps chains only")
        index = torch.tensor([*range(length), *(length + r for r in rows)],
                             device=self._model.device)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)

    def _crop(self, length: int) -> None:
        if self._past is not None:
            if not self._past.crop(length):
                self._replay(length)
            return
        # per layer: a forward interrupted by an exception can leave layers of unequal length
        for layer in self._cache.layers:
            if isinstance(layer, DummyLayer):
                continue  # an MLP-only layer holds nothing
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)  # transformers 5 crops by a negative count of tokens

    def _reset(self) -> None:
        self._cache, self._past = self._new_cache()


def _recorder(store: Hidden, layer: int) -> Callable[[Any, Any, Any], None]:
    """A forward hook keeping a layer's output [rows, hidden] in store. Only forwards on the
    thread that made it: another session may run the shared layers meanwhile (the race's
    lanes decode at once). It holds the store, never the session."""
    thread = threading.get_ident()

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        if threading.get_ident() == thread:
            store[layer] = (output[0] if isinstance(output, tuple) else output)[0]
    return keep


def _tree_rows(parents: Sequence[int] | None, n: int) -> tuple[int, ...] | None:
    """parents as a tuple when they describe a tree, None for a chain (or no parents)."""
    parents = tree_parents(parents, n)
    if parents is not None and n > MAX_VERIFY_ROWS:
        raise SpecdeckError(f"a tree of {n} rows is over the {MAX_VERIFY_ROWS} a verify takes")
    return parents


def _tree_inputs(parents: tuple[int, ...], base: int, start: int, end: int, pad: int,
                 device: str) -> dict[str, torch.Tensor]:
    """position_ids (cache length + depth) and a boolean [1, 1, rows, keys] ancestor mask for
    rows start..end of a tree forward whose first row sits at `base` in the cache."""
    mask = torch.zeros((1, 1, end - start + pad, base + end + pad), dtype=torch.bool,
                       device=device)
    # the slots the lean forward attends to; padding rows see the prefix and themselves
    for row, seen in enumerate(tree_keys(parents, base, start, end, pad)):
        mask[0, 0, row, seen] = True
    positions = tree_positions(parents, base, start, end, pad)
    return {"position_ids": torch.tensor([positions], device=device), "attention_mask": mask}


def batchable(calls: Sequence[ForwardCall]) -> bool:
    """Whether the calls can run as one lean forward: distinct lean sessions of one model,
    alike in exactness, computing with the model's own output layer."""
    sessions = [call.session for call in calls]
    if not all(isinstance(s, LeanSession) and s.head is None for s in sessions):
        return False
    trees = any(tree_parents(call.parents, len(call.token_ids)) is not None for call in calls)
    if trees and not sessions[0]._model.capabilities.tree_attention:
        return False  # each call alone then, where the refusal names the reason
    return (len({id(s) for s in sessions}) == len(sessions)
            and len({(id(s._model), s.exact) for s in sessions}) == 1)


def forward_together(calls: Sequence[ForwardCall]) -> list[TargetOutput]:
    """Each call's session.forward, computed as one forward over all their rows (batchable
    calls): the rows are cut into the sessions' exact blocks across calls, so every row sees
    the kernels it sees alone, and each block pads to min_rows as one session's would."""
    sessions: list[LeanSession] = [call.session for call in calls]
    reals = [[int(t) for t in call.token_ids] for call in calls]
    trees = [_tree_rows(call.parents, len(real)) for call, real in zip(calls, reals)]
    wants = [s._wanted(call.capture) for s, call in zip(sessions, calls)]
    bases = [s.length for s in sessions]
    parts: list[list[torch.Tensor]] = [[] for _ in calls]
    captured: list[dict[int, list[torch.Tensor]]] = [{i: [] for i in w} for w in wants]
    lead = sessions[0]
    size = lead._rows_per_block(sum(map(len, reals)))
    for block in _blocks([len(real) for real in reals], size):
        pad = max(lead.min_rows - sum(end - start for _, start, end in block), 0)
        pads = [pad if j == len(block) - 1 else 0 for j in range(len(block))]
        keeps, segments = [], []
        for (c, start, end), extra in zip(block, pads):
            rows = reals[c][start:end]
            keep = max(end - max(start, len(reals[c]) - calls[c].n_logits), 0)
            keeps.append(keep)
            segments.append(sessions[c].segment(Block(
                tuple(rows + rows[-1:] * extra), bases[c], start, end, extra, trees[c],
                keep + extra, len(reals[c]))))
        outs = lead._lean.forward_segments(segments, frozenset().union(*wants))
        for (c, start, end), extra, keep, (logits, hidden) in zip(block, pads, keeps, outs):
            parts[c].append(logits[:keep])
            for layer in wants[c]:
                captured[c][layer].append(hidden[layer][:end - start])
            if extra:
                sessions[c]._crop(sessions[c].length - extra)
    return [s._appended(real, p, h) for s, real, p, h in zip(sessions, reals, parts, captured)]


def _blocks(lengths: Sequence[int], size: int) -> list[list[tuple[int, int, int]]]:
    """The calls' rows, laid end to end, in blocks of at most `size` rows: each block a list
    of (call, start, end) spans."""
    blocks: list[list[tuple[int, int, int]]] = [[]]
    room = size
    for c, n in enumerate(lengths):
        start = 0
        while start < n:
            if room == 0:
                blocks.append([])
                room = size
            end = min(n, start + room)
            blocks[-1].append((c, start, end))
            room -= end - start
            start = end
    return [b for b in blocks if b]
