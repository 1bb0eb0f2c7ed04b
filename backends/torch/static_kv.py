"""The lean forward's KV cache and the slots each row sees in it: preallocated slots per
layer geometry (a sliding window, key heads, head width), a window's group sliding so it holds
its last tokens rather than the context, and the visible slots of a chain's, a tree's and a
window's rows.

Knows: torch tensors, token positions and slots, trees as parent lists. Must not know: models
or their modules, the forward's math (decoder.py), sessions' block splitting (session.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backends.torch.attention import MAX_ROWWISE_ROWS

FIRST_CAPACITY = 512  # cache slots allocated at first; doubled as the sequence grows
# tokens a sliding window keeps past what its next row sees: a rewind that far back (a
# drafter's k steps, a rejected verify) needs no replay
SPARE = MAX_ROWWISE_ROWS

Keys = slice | torch.Tensor  # the cache slots one query row attends to


@dataclass(frozen=True)
class Geometry:
    """One layer's cache: its sliding window (None: full attention), key heads, head width."""

    window: int | None
    kv_heads: int
    head_dim: int


class _Group:
    """Keys and values of the layers that share a Geometry (a window or none, key heads, head
    width) in slots [layers, kv heads, slots, dim]; slot i holds token offset + i. A window's
    group lets go of tokens no row will see again, so it holds window + 2 SPARE slots, not the
    context: window - 1 + SPARE tokens kept at a slide, room for a verify's rows after them. A
    slide copies the kept rows, every SPARE tokens or so: a few rows a token."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 limit: int, window: int | None) -> None:
        self.window, self.limit, self.offset = window, limit, 0
        self.base = limit if window is None else min(limit, window + 2 * SPARE)
        shape = (n_layers, kv_heads, min(FIRST_CAPACITY, self.base), head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)

    def reserve(self, length: int, end: int) -> None:
        """Room for tokens up to `end` after the first `length` (doubling, up to the
        context length); a window slides first once its slots are spent."""
        if self.window is not None:
            keep = max(0, length - (self.window - 1) - SPARE)
            if end - self.offset > self.base and keep > self.offset:
                self._slide(keep, length)
        need, have = end - self.offset, self.keys.shape[2]
        if need > have:
            self._copy(self.offset, have, min(max(need, 2 * have), max(self.limit, need)))

    def reaches(self, length: int) -> bool:
        """Whether a row at position `length` finds every token it sees."""
        return self.window is None or self.offset <= max(0, length - (self.window - 1))

    def select(self, length: int, tokens: Sequence[int]) -> None:
        """Keep the first `length` tokens, then `tokens` (ascending), in order."""
        index = torch.tensor([t - self.offset for t in tokens], dtype=torch.long)
        at = length - self.offset
        # slots grown inside a forward are inference tensors, writable only in inference mode
        # (a tree's kept path after a 600-token rag prompt raised here, outside it)
        with torch.inference_mode():
            self.keys[:, :, at:at + len(index)] = self.keys.index_select(2, index)
            self.values[:, :, at:at + len(index)] = self.values.index_select(2, index)

    def _slide(self, keep: int, length: int) -> None:
        """Tokens keep..length - 1 into slots 0.., in base slots again where they fit (a long
        prompt grew them)."""
        self._copy(keep, length - keep, max(length - keep, min(self.keys.shape[2], self.base)))

    def _copy(self, token: int, count: int, size: int) -> None:
        """New tensors of `size` slots holding `count` tokens from `token` on, at slot 0."""
        at = token - self.offset
        with torch.inference_mode():
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros((*old.shape[:2], size, old.shape[3]))
                new[:, :, :count] = old[:, :, at:at + count]
                setattr(self, name, new)
        self.offset = token


class StaticKV:
    """Keys and values of every layer in preallocated slots, one group per layer Geometry:
    full-attention layers for the whole context, each sliding window's layers for its last
    tokens; cutting back is setting `length`, within what the windows still hold
    (`reaches`)."""

    def __init__(self, geometry: Sequence[Geometry], dtype: torch.dtype, limit: int) -> None:
        self.limit = limit
        self.length = 0
        kinds = list(dict.fromkeys(geometry))
        self._groups = [_Group(geometry.count(g), g.kv_heads, g.head_dim, dtype, limit, g.window)
                        for g in kinds]
        self._where = [(kinds.index(g), geometry[:i].count(g)) for i, g in enumerate(geometry)]

    def reserve(self, slots: int) -> None:
        """Room for `slots` tokens in all."""
        for group in self._groups:
            group.reserve(self.length, slots)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layer `index`'s keys and values [kv heads, slots, dim] and the token in slot 0."""
        group, at = self._where[index]
        held = self._groups[group]
        return held.keys[at], held.values[at], held.offset

    def offset(self, window: int | None) -> int:
        """The token in slot 0 of the layers with this window (groups of one window slide
        together: they reserve alike)."""
        return next(g.offset for g in self._groups if g.window == window)

    def reaches(self, length: int) -> bool:
        """Whether cutting back to `length` tokens keeps what the next row sees."""
        return all(group.reaches(length) for group in self._groups)

    def select(self, length: int, slots: Sequence[int]) -> None:
        """Keep the first `length` tokens, then the tokens in `slots` (ascending), in order."""
        for group in self._groups:
            group.select(length, slots)
        self.length = length + len(slots)


def window_keys(keys: Sequence[Keys] | None, first: int, n: int, window: int,
                offset: int) -> list[Keys]:
    """Each chain row's slots in a sliding-window layer whose slot 0 holds token `offset`:
    the window's last tokens up to its own. Trees are refused on these targets first."""
    out: list[Keys] = []
    for r in range(n):
        seen = slice(0, first + r + 1) if keys is None else keys[r]
        if not isinstance(seen, slice):
            raise ValueError("a sliding-window layer attends along a chain only")
        out.append(slice(max(0, seen.stop - window) - offset, seen.stop - offset))
    return out


def chain_keys(first: int, n: int) -> list[Keys] | None:
    """Each row of a chain sees every slot up to its own; None for a prompt (one causal
    call, as transformers computes it past the row-wise limit)."""
    if n > MAX_ROWWISE_ROWS:
        return None
    return [slice(0, first + r + 1) for r in range(n)]


def tree_keys(parents: Sequence[int], base: int, start: int, end: int, pad: int) -> list[Keys]:
    """Rows start..end of a tree whose row 0 sits in slot `base`: the prefix and the row's
    ancestors in slot order (a slice where contiguous); padding rows see the prefix and
    themselves."""
    out: list[Keys] = []
    for r in range(start, end):
        path, node = [], r
        while node >= 0:
            path.append(base + node)
            node = parents[node]
        path.reverse()
        out.append(_slots(base, path))
    out += [_slots(base, [base + end + i]) for i in range(pad)]
    return out


def _slots(base: int, extra: list[int]) -> Keys:
    if extra == list(range(base, base + len(extra))):
        return slice(0, base + len(extra))
    return torch.tensor([*range(base), *extra], dtype=torch.long)


def tree_positions(parents: Sequence[int], base: int, start: int, end: int,
                   pad: int) -> list[int]:
    """Position ids of rows start..end (cache length + depth), then of padding rows."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    positions = [base + d for d in depth[start:end]]
    return positions + [positions[-1] + 1 + i for i in range(pad)]
