"""MLX + mlx-lm adapter: load a target, run forwards on an mlx-lm prompt cache, trim it back.

Knows: mlx-lm's model loading (HF-format folders: mlx-community repos, quantized or not, and
the safetensors folder backends/gguf.py converts a GGUF into), its cache classes and their
trim contract, MLX devices, dtypes and memory counters, layer hooks for hidden-state capture.
Must not know: drafting or verification rules (app/), sampling (app/core/sampling.py turns the
host logits of both backends into probabilities, so plain and speculative decoding share one
pipeline on MLX too; mlx-lm's own sampler, which filters before temperature, is not used).
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_config, load_model
from transformers import AutoTokenizer

from app.core.protocols import Capabilities, DrafterRequest, TargetOutput, collect_eos_ids
from app.core.types import SpecdeckError, tree_parents
from app.drafters.kinds import require_built
from backends.builder_table import build
from backends.gguf import hf_folder
from backends.mlx import BUILDERS, RUNS
from backends.mlx import rewind as mlx_rewind
from backends.mlx import tree as mlx_tree
from backends.mlx.layouts import config_fixes, model_classes

PREFILL_CHUNK = 2048  # prompt tokens per forward while prefilling (bounds activation memory)
_DTYPES = {"float32": mx.float32, "fp32": mx.float32, "bfloat16": mx.bfloat16,
           "bf16": mx.bfloat16, "float16": mx.float16, "fp16": mx.float16}
_GPU_NAMES = ("gpu", "metal", "mps", "cuda")


def resolve_device(device: str) -> mx.Device:
    """auto: MLX's GPU (Metal on Apple silicon) when this build has one, else the CPU."""
    if device == "auto":
        return mx.gpu if mx.is_available(mx.gpu) else mx.cpu
    if device == "cpu":
        return mx.cpu
    if device in _GPU_NAMES:
        if not mx.is_available(mx.gpu):
            raise SpecdeckError(f"--device {device} was asked for but this MLX build has no GPU "
                                "(the Linux mlx[cpu] build is CPU-only); use --device cpu")
        return mx.gpu
    raise SpecdeckError(f"unknown device {device!r} for MLX: use auto, cpu or gpu")


def resolve_dtype(dtype: str, device: mx.Device, stored: mx.Dtype) -> mx.Dtype:
    """auto: float32 on CPU (exact greedy parity); on GPU the checkpoint's half type or bf16."""
    if dtype == "auto":
        if device == mx.cpu:
            return mx.float32
        return stored if stored in (mx.float16, mx.bfloat16) else mx.bfloat16
    if dtype not in _DTYPES:
        raise SpecdeckError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


class MlxSession:
    """One mlx-lm prompt cache; forward appends a chain or a tree, keep and rewind cut it back.

    A tree forward (parents given) runs its rows in one call at their own positions under an
    ancestor mask (backends/mlx/tree.py); a chain runs as mlx-lm runs it, untouched. Windows
    and recurrent states are cut back as backends/mlx/rewind.py says.
    """

    def __init__(self, model: MlxModel, capture_layers: Sequence[int]) -> None:
        self._model = model
        self._cache = mlx_rewind.session_cache(make_prompt_cache(model.net))
        self._checkpoints = mlx_rewind.Checkpoints(self._cache)
        self._capture = tuple(capture_layers)
        # ids in the cache; a greedy chain's device-side tokens stay arrays until read
        self._ids: list[int | mx.array] = []

    @property
    def length(self) -> int:
        # recurrent layers count no tokens: an attention layer's cache does
        counted = [c for c in mlx_rewind.leaves(self._cache) if hasattr(c, "offset")]
        return int(counted[0].offset) if counted else len(self._ids)

    @property
    def tokens(self) -> tuple[int, ...]:
        if any(isinstance(t, mx.array) for t in self._ids):
            self._ids = [t if isinstance(t, int) else int(t.item()) for t in self._ids]
        return tuple(self._ids)  # type: ignore[arg-type]

    def forward(self, token_ids: Sequence[int], n_logits: int = 1,
                parents: Sequence[int] | None = None,
                capture: Sequence[int] = ()) -> TargetOutput:
        tree = self._tree(parents, len(token_ids))
        with self._recording((*self._capture, *capture)) as captured:
            logits = (self.logits(list(token_ids), n_logits) if tree is None  # [n_logits, vocab]
                      else self._tree_logits([int(t) for t in token_ids], tree, n_logits))
        hidden = {i: mx.concatenate(rows, axis=0) for i, rows in captured.items()}
        argmax = mx.argmax(logits, axis=-1)
        mx.eval(argmax, logits, *hidden.values())
        return TargetOutput(argmax=tuple(argmax.tolist()),
                            logits_fn=lambda: np.array(logits.astype(mx.float32)),
                            hidden_states=hidden)

    def keep(self, length: int, rows: Sequence[int]) -> None:
        rows = [int(r) for r in rows]
        if rows == list(range(len(rows))):
            self.rewind(length + len(rows))
            return
        self._refuse_trees()
        if any(not 0 <= length + r < self.length for r in rows):
            raise ValueError(f"cannot keep rows {rows} after {length} of {self.length} tokens")
        mlx_tree.keep_path(self._cache, length, rows)
        self._ids[length:] = [self._ids[length + r] for r in rows]

    def _tree(self, parents: Sequence[int] | None, n: int) -> tuple[int, ...] | None:
        """parents as a tuple when they describe a tree, None for a chain (or none given)."""
        tree = tree_parents(parents, n)
        if tree is not None:
            self._refuse_trees()
        return tree

    def _refuse_trees(self) -> None:
        if not self._model.capabilities.tree_attention:
            raise SpecdeckError(f"{self._model.name} cannot verify trees on MLX: "
                                f"{self._model.capabilities.reason}")

    def _tree_logits(self, token_ids: list[int], parents: tuple[int, ...],
                     n_logits: int) -> mx.array:
        """Append a tree's rows in one call; lazy logits [n_logits, vocab] of its last rows."""
        self._ids.extend(token_ids)
        n = min(max(n_logits, 1), len(token_ids))
        net = self._model.net
        # the positions and mask are read while the graph is built, inside the context
        with mx.stream(self._model.stream), mlx_tree.tree_rows(net, self._cache, parents,
                                                                self._model.compute_dtype):
            return net(mx.array(token_ids)[None], cache=self._cache)[0, len(token_ids) - n:]

    def logits(self, token_ids: Sequence[int] | mx.array, n_logits: int = 1) -> mx.array:
        """Append token_ids; lazy logits [n_logits, vocab] of the last inputs, on the device.

        Rows before the last n_logits go through the model without the output layer ever
        running: MLX computes only what is evaluated, and only the cache state is.
        """
        if self._checkpoints.needed:
            self._checkpoints.mark(self.length)
        if isinstance(token_ids, mx.array):
            ids = token_ids
            self._ids.extend(token_ids[i] for i in range(token_ids.size))
        else:
            ids = mx.array(list(token_ids))
            self._ids.extend(int(t) for t in token_ids)
        n = min(max(n_logits, 1), ids.size)
        head, tail = ids[:ids.size - n], ids[ids.size - n:]
        with mx.stream(self._model.stream):
            for start in range(0, head.size, PREFILL_CHUNK):
                self._model.net(head[None, start:start + PREFILL_CHUNK], cache=self._cache)
                mx.eval([c.state for c in self._cache])
            return self._model.net(tail[None], cache=self._cache)[0]

    def rewind(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} tokens to {length}")
        if self._checkpoints.needed and length < self.length:
            self._restore(length)
        elif self._cuts_to(length):
            self._trim(length)
        else:
            self._replay(length)

    def _cuts_to(self, length: int) -> bool:
        return all(mlx_rewind.cuts(c, getattr(c, "offset", length) - length)
                   for c in mlx_rewind.leaves(self._cache))

    def _trim(self, length: int) -> None:
        # per layer: a forward interrupted by an exception can leave layers of unequal length
        for cache in mlx_rewind.leaves(self._cache):
            extra = getattr(cache, "offset", length) - length
            if extra > 0:
                cache.trim(extra)
        del self._ids[length:]

    def _restore(self, length: int) -> None:
        """Recurrent states: back to the newest checkpoint at or below length, then the
        tokens from there to length decoded again (lazily: the next forward computes them)."""
        kept = list(self.tokens[:length])
        start = self._checkpoints.restore(length)
        if start is None or not self._cuts_to(start):
            self._replay(length)
            return
        self._trim(start)
        if length > start:
            self.logits(kept[start:])

    def _replay(self, length: int) -> None:
        """The cache of the first `length` tokens, computed again: a window or a recurrent
        state has lost what a cut back would need (a new prompt sharing an old prefix)."""
        kept = list(self.tokens[:length])
        self._cache = mlx_rewind.session_cache(make_prompt_cache(self._model.net))
        self._checkpoints, self._ids = mlx_rewind.Checkpoints(self._cache), []
        if kept:
            mx.eval(self.logits(kept))

    @contextmanager
    def _recording(self, capture: Sequence[int]) -> Iterator[dict[int, list[mx.array]]]:
        """Point the chosen layers at a fresh store for the calls inside (hooked on first use)."""
        bad = [i for i in capture if not 0 <= i < self._model.n_layers]
        if bad:
            raise SpecdeckError(f"{self._model.name} has {self._model.n_layers} layers; "
                                f"cannot capture {bad}")
        captured: dict[int, list[mx.array]] = {i: [] for i in capture}
        layers = [self._model.net.layers[i] for i in captured]
        for i, layer in zip(captured, layers):
            _hook(layer, i)
        for layer in layers:
            layer._specdeck_sink = captured[layer._specdeck_index].append
        try:
            yield captured
        finally:
            for layer in layers:
                layer._specdeck_sink = None


class MlxModel:
    """A loaded mlx-lm model and its tokenizer."""

    def __init__(self, net: Any, tokenizer: Any, config: dict[str, Any], name: str,
                 device: mx.Device) -> None:
        self.net = net
        self.tokenizer = tokenizer
        self.name = name
        self.source: Path | None = None  # the folder it was loaded from, when it was
        self.stream = device
        self.device = "cpu" if device == mx.cpu else "gpu"
        text = config.get("text_config", {}) | config
        self.context_length = int(text.get("max_position_embeddings") or 4096)
        self.eos_token_ids = _eos_ids(text.get("eos_token_id"), tokenizer)
        self.n_layers = len(net.layers)
        self.dtype = _describe_dtype(net, config)
        self.compute_dtype = _stored_dtype(net)  # the activations' (a tree mask's) dtype
        why_not = mlx_tree.unsupported(net)
        self.capabilities = _capabilities(make_prompt_cache(net), why_not)
        self.vocab_size = int(self.start().logits([0]).shape[-1])  # rows of the output layer

    def start(self, capture_layers: Sequence[int] = (), exact: bool = True) -> MlxSession:
        bad = [i for i in capture_layers if not 0 <= i < self.n_layers]
        if bad:
            raise SpecdeckError(f"{self.name} has {self.n_layers} layers; cannot capture {bad}")
        return MlxSession(self, capture_layers)

    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.net.parameters()))

    def peak_memory_bytes(self) -> int:
        """MLX's own peak (Metal or CPU allocations); the process RSS peak if it has none."""
        peak = int(_memory("get_peak_memory"))
        return peak or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def active_memory_bytes(self) -> int:
        return int(_memory("get_active_memory"))


class MlxBackend:
    """Loads HF-format folders (and the converted copy of a .gguf); builds the drafter."""

    name = "mlx"
    runs = RUNS

    def load(self, path: str, device: str = "auto", dtype: str = "auto") -> MlxModel:
        stream = resolve_device(device)
        folder = hf_folder(Path(path))
        config = load_config(folder)
        try:
            with mx.stream(stream):
                net, config = load_model(folder, model_config=config_fixes(config),
                                         get_model_classes=model_classes)
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError, RuntimeError) as error:  # mx.load: RuntimeError
            raise SpecdeckError(f"could not load a model from {path} with MLX: {error}. Check "
                                "that the folder holds config.json, *.safetensors weights and "
                                "tokenizer files, or use --backend torch") from error
        net.set_dtype(resolve_dtype(dtype, stream, _stored_dtype(net)))
        mx.eval(net.parameters())
        model = MlxModel(net, tokenizer, config, name=_display_name(Path(path)), device=stream)
        model.source = folder  # MTP layers are read from the checkpoint's own files
        return model

    def make_drafter(self, kind: str, target: MlxModel, *, draft: MlxModel | None = None,
                     head: str | None = None, tree: bool = False, vocab_limit: int = 0) -> Any:
        """The drafter of a kind this backend builds (BUILDERS), checked against the target."""
        require_built(kind, self.runs, capabilities=target.capabilities, tree=tree,
                      has_draft=draft is not None, has_head=bool(head), target=target.name)
        request = DrafterRequest(kind, target, draft, head, tree, vocab_limit)
        return build(BUILDERS, "backends.mlx.builders", request)

def _capabilities(cache: list[Any], no_trees: str) -> Capabilities:
    """Every cache layer rewinds (rewind.py); a window or a state verifies chains only."""
    if mlx_rewind.stateful(cache):
        return Capabilities(rewind=True, hidden_states=True, reason=mlx_rewind.RECURRENT_CHAINS)
    if any(isinstance(c, RotatingKVCache) for c in mlx_rewind.leaves(cache)):
        return Capabilities(rewind=True, hidden_states=True, reason=mlx_rewind.WINDOW_CHAINS)
    return Capabilities(rewind=True, hidden_states=True, tree_attention=not no_trees,
                        reason=no_trees)


def _hook(layer: Any, index: int) -> None:
    """Make layer hand its output to its `_specdeck_sink` when one is set (idempotent).

    The instance's class is swapped for a subclass, so parameter paths and attributes stay
    those mlx-lm knows, and the layer list (a copy on some models) needs no editing.
    """
    if not getattr(type(layer), "_specdeck_hooked", False):
        layer.__class__ = _hooked_class(type(layer))
    layer._specdeck_index = index
    layer._specdeck_sink = None


_HOOKED: dict[type, type] = {}


def _hooked_class(cls: type) -> type:
    if cls not in _HOOKED:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = cls.__call__(self, *args, **kwargs)
            sink: Callable[[mx.array], None] | None = self._specdeck_sink
            if sink is not None:
                sink((out[0] if isinstance(out, tuple) else out)[0])  # [rows, hidden]
            return out
        _HOOKED[cls] = type(f"Hooked{cls.__name__}", (cls,),
                            {"__call__": call, "_specdeck_hooked": True})
    return _HOOKED[cls]


def _stored_dtype(net: Any) -> mx.Dtype:
    """The floating dtype holding most of the weights (quantized packs are integers)."""
    sizes: dict[mx.Dtype, int] = {}
    for _, value in tree_flatten(net.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            sizes[value.dtype] = sizes.get(value.dtype, 0) + value.size
    return max(sizes, key=sizes.get) if sizes else mx.float32


def _describe_dtype(net: Any, config: dict[str, Any]) -> str:
    name = str(_stored_dtype(net)).removeprefix("mlx.core.")
    bits = (config.get("quantization") or {}).get("bits")
    return f"{bits}-bit/{name}" if bits else name


def _eos_ids(config_eos: Any, tokenizer: Any) -> frozenset[int]:
    """Every end-of-sequence id the config (generation_config included) and tokenizer declare."""
    return collect_eos_ids(config_eos, tokenizer.eos_token_id)


def _memory(counter: str) -> int:
    # mlx >= 0.24 has top-level counters; older releases keep them under mx.metal
    fn = getattr(mx, counter, None) or getattr(mx.metal, counter)
    return fn()


def _display_name(path: Path) -> str:
    return path.name.removesuffix(".gguf") or str(path)
