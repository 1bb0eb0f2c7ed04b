"""Backend selection: detect_backend() picks one for this machine; load_backend(name) imports it.

Knows: which adapters exist, what hardware each needs, and what each runs (`runs_of`: its
package's RUNS, which imports no array library). The adapters themselves are imported lazily
so that the app starts without torch or mlx installed and names the missing extra instead of
crashing.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
from typing import Any

from app.core.protocols import Runs
from app.core.types import SpecdeckError
from backends.extras import BACKENDS, install_hint
from backends.llamacpp import RUNS as LLAMACPP_RUNS
from backends.mlx import RUNS as MLX_RUNS
from backends.torch import RUNS as TORCH_RUNS

_RUNS = {runs.backend: runs for runs in (TORCH_RUNS, MLX_RUNS, LLAMACPP_RUNS)}


def detect_backend() -> str:
    """MLX on Apple silicon, torch elsewhere (CUDA when present, else CPU)."""
    apple = platform.system() == "Darwin" and platform.machine() == "arm64"
    if apple and importlib.util.find_spec("mlx_lm") is not None:
        return "mlx"
    return "torch"


def load_backend(name: str = "auto") -> Any:
    """The backend object for name ('auto', 'torch', 'mlx' or 'llamacpp')."""
    name = detect_backend() if name == "auto" else name
    if name == "torch":
        _need("torch", "torch")
        _need("transformers", "torch")
        from backends.torch.backend import TorchBackend
        return TorchBackend()
    if name == "mlx":
        _need("mlx", "mlx")
        _need("mlx_lm", "mlx")
        from backends.mlx.backend import MlxBackend
        return MlxBackend()
    if name == "llamacpp":
        _need("llama_cpp", "llamacpp")
        _need("transformers", "torch")  # the GGUF's tokenizer, read by transformers
        from backends.llamacpp.backend import LlamaCppBackend
        return LlamaCppBackend()
    raise SpecdeckError(f"unknown backend {name!r}: use auto, {' or '.join(BACKENDS)}")


def runs_of(name: str = "auto") -> Runs:
    """What the backend of this name ('auto' too) runs, without importing its array library."""
    name = detect_backend() if name == "auto" else name
    if name not in _RUNS:
        raise SpecdeckError(f"unknown backend {name!r}: use auto, {' or '.join(BACKENDS)}")
    return _RUNS[name]


def _need(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise SpecdeckError(f"the {extra} backend needs {module}: {install_hint(extra)} "
                            f"(from a specdeck checkout: pip install -e '.[{extra}]')")

