"""What this machine offers a backend: its device, the memory free for models now (psutil for RAM,
nvidia-smi for CUDA, about 75% of RAM for MLX's Metal working set), and the dtype a backend
computes a source in here.

Knows: psutil, nvidia-smi, which kernels build here (without importing torch's modules).
Must not know: the catalogue, drafters or the planner's choice.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from app.catalogue.registry import FORMAT_BITS

MLX_WORKING_SET = 0.75  # Metal lets a process wire about this share of RAM by default
W8A8_MAX_BITS = 8.5  # --dtype auto runs a source this coarse as w8a8 (backends/torch)
INT4_MAX_BITS = 5.0  # and a source this coarse as int4, where torch has the kernel
INT4_TORCH = (2, 6)  # the first torch with _weight_int4pack_mm_for_cpu


def resolve_device(backend: str, device: str = "auto") -> str:
    if backend == "mlx":
        return "gpu"
    if device == "auto":
        return "cuda" if cuda_free_bytes() is not None else "cpu"
    return device


def dtype_for(backend: str, device: str, fmt: str | None = None,
              bits: float | None = None, gguf: bool | None = None) -> str:
    """The dtype `--dtype auto` loads weights in: MLX float16; on a CPU a GGUF (gguf: the
    source is one; by default read from fmt) on its own blocks where a kernel for them runs;
    else, for a source of 5 bits per weight or fewer (a Q4 GGUF), w4a8 with AVX512-VNNI, else
    int4 where torch has its int4 kernel; w8a8 with VNNI for 8.5 bits or fewer, else bfloat16
    on CUDA and on CPUs with native bf16, else float32 (backends/torch/backend.py decides the
    same way, after its exactness checks)."""
    from backends.cpu import cpu_has_native_bf16, cpu_has_vnni, cpu_has_w4a8

    if backend == "mlx":
        return "float16"
    gguf = bool(fmt and fmt.startswith("gguf-")) if gguf is None else gguf
    if device == "cpu" and gguf and _gguf_runs_here():
        return "gguf"
    if bits is None and fmt:
        bits = _quant_bits(fmt)
    four_bit = device == "cpu" and bits is not None and bits <= INT4_MAX_BITS
    if four_bit and cpu_has_w4a8():
        return "w4a8"
    if four_bit and _torch_has_int4():
        return "int4"
    if device == "cpu" and bits is not None and bits <= W8A8_MAX_BITS and cpu_has_vnni():
        return "w8a8"
    if device.startswith("cuda") or cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


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
    without importing torch: kquant needs AVX512-VNNI, ggml llama-cpp-python; both a compiler."""
    import importlib.util

    from backends.cbuild import compiler
    from backends.cpu import cpu_has_w4a8

    kernel = cpu_has_w4a8() or importlib.util.find_spec("llama_cpp") is not None
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
