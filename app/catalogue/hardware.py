"""What this machine offers a backend: its device, the memory free for models now (psutil for RAM,
nvidia-smi for CUDA, about 75% of RAM for MLX's Metal working set), and the dtype a backend
computes a source in here.

Knows: psutil, nvidia-smi, which kernels build here (without importing torch or backends.torch).
Must not know: the catalogue, drafters or the planner's choice.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from app.catalogue.registry import FORMAT_BITS
from backends.dtype_rule import Probes, Source, auto_dtype

MLX_WORKING_SET = 0.75  # Metal lets a process wire about this share of RAM by default
INT4_TORCH = (2, 6)  # the first torch with _weight_int4pack_mm_for_cpu


def resolve_device(backend: str, device: str = "auto") -> str:
    if backend == "mlx":
        return "gpu"
    if device == "auto":
        return "cuda" if cuda_free_bytes() is not None else "cpu"
    return device


def dtype_for(backend: str, device: str, fmt: str | None = None,
              bits: float | None = None, gguf: bool | None = None) -> str:
    """The dtype `--dtype auto` loads weights in: MLX float16; torch's by the one rule
    (backends/dtype_rule.py) asked with what this machine predicts. gguf: the source is one
    (by default read from fmt); bits: its bits per weight (by default fmt's)."""
    if backend == "mlx":
        return "float16"  # MLX computes every source in float16 (backends/mlx)
    gguf = bool(fmt and fmt.startswith("gguf-")) if gguf is None else gguf
    if bits is None and fmt:
        bits = _quant_bits(fmt)
    return auto_dtype(Source(gguf, None, bits), predicted_probes(), device)[0]


def predicted_probes() -> Probes:
    """The rule's probes as this machine predicts them without importing torch: CPU flags,
    the torch version, a compiler; the loader's exactness checks decide (looked up when asked)."""
    from backends import cpu

    return Probes(gguf=lambda: _gguf_runs_here(), w4a8=lambda: cpu.cpu_has_w4a8(),
                  int4=lambda: _torch_has_int4(), w8a8=lambda: cpu.cpu_has_vnni(),
                  native_bf16=lambda: cpu.cpu_has_native_bf16())


def _quant_bits(fmt: str) -> float | None:
    """The bits per weight of a catalogue format's main tensors, as the GGUF header names them
    (the backend decides from the header; FORMAT_BITS is file size, embeddings included)."""
    from backends.gguf_header import FILE_TYPES

    if fmt.startswith("gguf-"):
        name = fmt.removeprefix("gguf-").upper()
        return next((bits for n, bits in FILE_TYPES.values() if n == name), FORMAT_BITS.get(fmt))
    return FORMAT_BITS.get(fmt)


def _gguf_runs_here() -> bool:
    """Whether torch runs a GGUF on its own blocks here (backends/torch/gguf_model.py), judged
    without importing torch: kquant needs AVX-512 VNNI or AVX2, ggml llama-cpp-python; both a
    compiler."""
    import importlib.util

    from backends.cbuild import compiler
    from backends.cpu import kernel_isa

    kernel = kernel_isa() is not None or importlib.util.find_spec("llama_cpp") is not None
    return kernel and compiler() is not None


def _torch_has_int4() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = re.match(r"(\d+)\.(\d+)", version("torch"))
    except PackageNotFoundError:
        return False
    return release is not None and (int(release[1]), int(release[2])) >= INT4_TORCH


def available_memory(backend: str, device: str = "auto") -> int:
    import psutil

    device = resolve_device(backend, device)
    ram = psutil.virtual_memory()
    if backend == "mlx":
        return int(min(ram.available, ram.total * MLX_WORKING_SET))
    if device.startswith("cuda"):
        free = cuda_free_bytes()
        if free is not None:
            return free
    return int(ram.available)


def cuda_free_bytes() -> int | None:
    """Free memory of the first CUDA GPU via nvidia-smi (no torch import), or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
