"""The one rule behind `--dtype auto` on torch: the fastest mode whose weights are no coarser
than the source's and whose kernel computes exactly here. The torch loader asks it with
measured probes (its exactness checks), the planner with predictions (CPU flags, versions).

Knows: the modes' order, the bits-per-weight thresholds, the reason each choice gives.
Must not know: torch, files or CPU flags (a probe answers those), the catalogue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FOUR_BIT_MAX_BITS = 5.0  # int4's bits per weight: 4-bit codes, a bf16 scale and zero per 32
W8A8_MAX_BITS = 8.5  # Q8_0's: int8 codes and a 16-bit scale per block of 32


@dataclass(frozen=True)
class Source:
    """What the rule knows of a source: whether it is a GGUF, and the name and bits per weight
    of its main tensors (None or 0: unknown, or a 16-bit or wider folder)."""

    gguf: bool = False
    name: str | None = None
    bits: float | None = None


@dataclass(frozen=True)
class Probes:
    """Whether each mode runs exactly here. Each is asked only when the rule reaches it: a
    measured probe may build a kernel."""

    gguf: Callable[[], bool]  # a kernel on the GGUF's own blocks (kquant or ggml)
    w4a8: Callable[[], bool]
    int4: Callable[[], bool]
    w8a8: Callable[[], bool]
    native_bf16: Callable[[], bool]


def auto_dtype(source: Source, probes: Probes, device: str = "cpu") -> tuple[str, str]:
    """(dtype, why) that `--dtype auto` loads source in on torch's device."""
    if device != "cpu":
        return "bfloat16", f"bfloat16: {device} computes it natively"
    if source.gguf and probes.gguf():
        name = source.name or "GGUF"
        return "gguf", (f"gguf: the file's own {name} blocks times 8-bit activations, as "
                        "llama.cpp computes them: the model you downloaded, nothing converted")
    if not source.bits:
        base = _unquantized(probes)
        return base, f"{base}: a 16-bit or wider source stays unquantized"
    return _quantized(source.name or "GGUF", source.bits, probes)


def _quantized(name: str, bits: float, probes: Probes) -> tuple[str, str]:
    four_bit = bits <= FOUR_BIT_MAX_BITS
    if four_bit and probes.w4a8():
        return "w4a8", (f"w4a8: the {name} source has {bits} bits per weight; 4-bit weights "
                        "times 8-bit activations (as llama.cpp runs it) decode fastest and "
                        "passed the row check on this CPU")
    if four_bit and probes.int4():
        return "int4", (f"int4: the {name} source has {bits} bits per weight; 4-bit weights "
                        "(groups of 32) decode fastest and passed the row check on this CPU")
    if bits <= W8A8_MAX_BITS and probes.w8a8():
        return "w8a8", (f"w8a8: the {name} source has {bits} bits per weight; int8 weights "
                        "and activations pass the exactness check on this CPU")
    base = _unquantized(probes)
    return base, (f"{base}: the {name} source is finer than 8 bits per weight, or no int8 "
                  "matmul is exact on this CPU")


def _unquantized(probes: Probes) -> str:
    # bf16 where the CPU computes it natively: plain decoding ran 2.1x faster than fp32 here
    return "bfloat16" if probes.native_bf16() else "float32"
