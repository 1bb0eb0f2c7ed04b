"""What this CPU can do, read from /proc/cpuinfo: the probes behind `--dtype auto`, the
planner's memory sizes and the kernels built on first use.

Knows: the CPU flags. Must not know: anything else in specdeck (a leaf: imports only the
standard library).
"""

from __future__ import annotations

from pathlib import Path


def _cpuinfo() -> str:
    """/proc/cpuinfo's text (its flags lines), or "" where it cannot be read."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX on this CPU (Linux reports them in /proc/cpuinfo): torch's
    `--dtype auto` runs bfloat16 there, and the planner sizes memory for it."""
    flags = _cpuinfo()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_vnni() -> bool:
    """AVX512-VNNI, AVX-VNNI or AMX-INT8: where oneDNN's int8 matmul does not saturate, so
    torch's `--dtype auto` may run a quantized source as w8a8 (its load check decides)."""
    flags = _cpuinfo()
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


def cpu_has_w4a8() -> bool:
    """AVX512-VNNI with AVX512-BW/VL: what torch's w4a8 kernel (backends/torch/kernels/w4a8.c)
    is built for; the planner and `--dtype auto` prefer w4a8 to int4 there."""
    flags = _cpuinfo()
    return all(flag in flags for flag in ("avx512_vnni", "avx512bw", "avx512vl"))


def cpu_has_avx2() -> bool:
    """AVX2 with FMA and F16C, on the CPUs without AVX-512 (AMD Zen 2/3, Intel before Ice
    Lake)."""
    flags = _cpuinfo()
    return all(flag in flags for flag in ("avx2", "fma", "f16c"))


def kernel_isa() -> str | None:
    """Which build of kquant.c and lean_ops.c runs here: "avx512" where w4a8's CPU check
    holds, else "avx2", else None (neither kernel runs)."""
    if cpu_has_w4a8():
        return "avx512"
    return "avx2" if cpu_has_avx2() else None
