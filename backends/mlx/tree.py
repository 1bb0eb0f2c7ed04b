"""Tree forwards on mlx-lm models: each row at its own position (cache length + its depth),
seeing the cached prefix, its ancestors and itself; and keeping one path's KV rows after.

Knows: how the mlx-lm model modules in PATCHED call RoPE and build their mask (each layer's
`self_attn.rope(x, offset=cache.offset)` on [batch, heads, rows, dim], the model's
`cache.make_mask(rows, ...)` for the whole forward), KVCache's keys, values and offset.
Must not know: sessions' token bookkeeping, hidden-state capture, drafting or verification.

Why per-row RoPE this way: mx.fast.rope takes one offset per batch entry, so the tree's rows
are moved to the batch axis for the rotation; each row gets the bits a chain row at that
position gets (the rotation is elementwise).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

# mlx_lm.models modules whose attention rotates through `self_attn.rope` and masks through
# the cache's make_mask (read in mlx-lm 0.32); others are refused rather than guessed at
PATCHED = frozenset({"llama", "qwen2", "qwen3"})

_running = threading.local()  # the positions of the tree forward on this thread, if any


def unsupported(net: Any) -> str:
    """Why net cannot run tree forwards here, or '' when it can."""
    module = type(net).__module__.rpartition(".")[2]
    if module not in PATCHED:
        return (f"mlx-lm's {module} attention is not one specdeck rotates per row "
                f"({', '.join(sorted(PATCHED))} are): trees need --backend torch")
    if not all(hasattr(getattr(layer, "self_attn", None), "rope") for layer in net.layers):
        return f"a layer of this {module} model has no self_attn.rope to rotate per row"
    if any(type(cache) is not KVCache for cache in make_prompt_cache(net)):
        return "its cache is not mlx-lm's plain KVCache, whose rows a tree path keeps"
    return ""


def depths(parents: Sequence[int]) -> list[int]:
    """Each row's depth below the tree's roots (parents: -1 for a root, else an earlier row)."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def ancestor_mask(parents: Sequence[int], length: int, dtype: mx.Dtype) -> mx.array:
    """Additive [rows, length + rows] mask: 0 on the cached prefix, a row's ancestors and the
    row itself, -inf elsewhere."""
    n = len(parents)
    seen = np.zeros((n, length + n), dtype=bool)
    seen[:, :length] = True
    for row, parent in enumerate(parents):
        if parent >= 0:
            seen[row, length:] = seen[parent, length:]
        seen[row, length + row] = True
    return mx.array(np.where(seen, 0.0, -np.inf), dtype=dtype)


@contextmanager
def tree_rows(net: Any, caches: Sequence[Any], parents: Sequence[int],
              dtype: mx.Dtype) -> Iterator[None]:
    """Inside: net's forwards on caches run as this tree's rows (positions and mask)."""
    length = int(caches[0].offset)
    mask = ancestor_mask(parents, length, dtype)
    for layer in net.layers:
        _hook(layer.self_attn.rope)
    for cache in caches:
        cache.make_mask = lambda *_args, **_kwargs: mask  # an instance's, over the class's
    _running.positions = mx.array([length + d for d in depths(parents)])
    try:
        yield
    finally:
        _running.positions = None
        for cache in caches:
            vars(cache).pop("make_mask", None)


def keep_path(caches: Sequence[Any], length: int, rows: Sequence[int]) -> None:
    """Keep the first `length` cached rows, then those at length + r for r in rows, in order."""
    index = mx.array([length + r for r in rows])
    end = length + len(rows)
    for cache in caches:
        cache.keys[..., length:end, :] = cache.keys[..., index, :]
        cache.values[..., length:end, :] = cache.values[..., index, :]
        cache.offset = end


def _hook(rope: Any) -> None:
    """Make rope take this thread's tree positions while a tree forward runs (idempotent).

    The instance's class is swapped for a subclass, as backends/mlx/backend.py hooks layers:
    parameter paths stay mlx-lm's, and a chain forward pays one attribute read."""
    if not getattr(type(rope), "_specdeck_tree", False):
        rope.__class__ = _tree_class(type(rope))


_CLASSES: dict[type, type] = {}


def _tree_class(cls: type) -> type:
    if cls not in _CLASSES:
        def call(self: Any, x: mx.array, offset: Any = 0) -> mx.array:
            positions = getattr(_running, "positions", None)
            if positions is None:
                return cls.__call__(self, x, offset=offset)
            # rows to the batch axis: one offset each; [1, heads, rows, dim] and back
            return cls.__call__(self, x.swapaxes(0, 2), offset=positions).swapaxes(0, 2)
        _CLASSES[cls] = type(f"Tree{cls.__name__}", (cls,),
                             {"__call__": call, "_specdeck_tree": True})
    return _CLASSES[cls]
