"""The page's numeric controls, checked before any work starts.

Knows: every numeric control's bounds (the sliders take theirs from here, so the page and the
checks agree), what counts as a number (finite int or float, or text that reads as one; NaN,
±inf, booleans and other types are refused), and how the controls become SamplingParams and k.
Must not know: Gradio, engines, the busy lock. Every refusal is a SpecdeckError naming the
control as the page labels it, so the handler shows it and takes nothing.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from app.core.types import SamplingParams, SpecdeckError


@dataclass(frozen=True)
class Bounds:
    """One control's label in the page and the values it accepts (both ends included)."""

    label: str
    low: float
    high: float
    whole: bool = False


TEMPERATURE = Bounds("temperature", 0, 2)
TOP_P = Bounds("top-p", 0.05, 1)
TOP_K = Bounds("top-k", 0, 200, whole=True)
MIN_P = Bounds("min-p", 0, 0.5)
SEED = Bounds("seed", -1, 2**32 - 1, whole=True)  # -1 (or blank) draws a random seed
K = Bounds("k", 1, 16, whole=True)  # what the k dropdown offers, besides "auto"
CHAT_MAX_NEW = Bounds("max new tokens", 1, 4096, whole=True)
RACE_MAX_NEW = Bounds("max new tokens", 1, 2048, whole=True)
BENCH_MAX_NEW = Bounds("max new tokens", 1, 512, whole=True)
BENCH_LIMIT = Bounds("prompts per category", 1, 10, whole=True)


def number(value: object, bounds: Bounds) -> float:
    """`value` as a finite float within `bounds`, or a SpecdeckError that says what is allowed."""
    # bool is an int to Python, but True is no answer to "how many tokens"
    if isinstance(value, bool) or not isinstance(value, numbers.Real | str):
        raise SpecdeckError(f"{bounds.label} must be a number (got {_shown(value)})")
    try:
        x = float(value)
    except (ValueError, OverflowError):
        raise SpecdeckError(f"{bounds.label} must be a number (got {_shown(value)})") from None
    if not math.isfinite(x):
        raise SpecdeckError(f"{bounds.label} must be a finite number (got {_shown(value)})")
    if not bounds.low <= x <= bounds.high:
        raise SpecdeckError(f"{bounds.label} must be from {_plain(bounds.low)} to "
                            f"{_plain(bounds.high)} (got {_shown(value)})")
    if bounds.whole and not x.is_integer():
        raise SpecdeckError(f"{bounds.label} must be a whole number (got {_shown(value)})")
    return x


def whole(value: object, bounds: Bounds) -> int:
    return int(number(value, bounds))


def parse_k(value: object) -> int | str:
    """The k control: "auto" (chosen per step from measured costs) or a whole number in K."""
    if isinstance(value, str) and value.strip() == "auto":
        return "auto"
    try:
        return whole(value, K)
    except SpecdeckError:
        raise SpecdeckError(f"k must be auto or a whole number from {K.low} to {K.high} "
                            f"(got {_shown(value)})") from None


def parse_seed(value: object) -> int | None:
    """A blank or -1 seed means a random one; anything else must be a whole number >= 0."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    seed = whole(value, SEED)
    return None if seed == -1 else seed


def sampling_from(temperature: object, top_p: object, top_k: object, min_p: object,
                  max_new_tokens: object, seed: object,
                  max_new: Bounds = CHAT_MAX_NEW) -> SamplingParams:
    """The sampling controls' values as SamplingParams, each checked against its bounds."""
    return SamplingParams(temperature=number(temperature, TEMPERATURE),
                          top_p=number(top_p, TOP_P), top_k=whole(top_k, TOP_K),
                          min_p=number(min_p, MIN_P),
                          max_new_tokens=whole(max_new_tokens, max_new), seed=parse_seed(seed))


def _plain(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _shown(value: object) -> str:
    """The offending value, short: a pasted novel or a 400-digit number stays one line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
