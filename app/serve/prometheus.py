"""Prometheus text exposition: parse what an engine's /metrics serves, write our own.

Knows: the text format (version 0.0.4: `# HELP` / `# TYPE` comments, `name{label="v"} value
[timestamp]`, escaped label values, NaN and +Inf). Must not know: which engine wrote the
text or what its metrics mean; app/serve/remote_engine.py reads vLLM's and SGLang's names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(?P<labels>.*)\})?\s+"
                     r"(?P<value>\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    """One line of the exposition: a metric name, its labels and a value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def parse(text: str) -> list[Sample]:
    """Every sample in the text; comments, blank lines and unreadable lines are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        value = _number(match["value"])
        labels = _labels(match["labels"] or "")
        if value is not None and labels is not None:
            samples.append(Sample(match["name"], labels, value))
    return samples


def total(samples: Iterable[Sample], name: str) -> float | None:
    """Sum of every series of one metric (all engines, ranks, models); None if absent."""
    values = [s.value for s in samples if s.name == name and not math.isnan(s.value)]
    return sum(values) if values else None


def mean(samples: Iterable[Sample], name: str) -> float | None:
    """Mean over the series of one gauge (one per rank); None if absent."""
    values = [s.value for s in samples if s.name == name and not math.isnan(s.value)]
    return sum(values) / len(values) if values else None


def by_label(samples: Iterable[Sample], name: str, key: str) -> dict[str, float]:
    """One metric's values summed per value of one label (e.g. per `position`)."""
    out: dict[str, float] = {}
    for s in samples:
        value = s.label(key)
        if s.name == name and value is not None and not math.isnan(s.value):
            out[value] = out.get(value, 0.0) + s.value
    return out


def render(name: str, kind: str, help_text: str,
           series: Iterable[tuple[Mapping[str, str], float]]) -> str:
    """One metric family in the text format, the way prometheus_client writes it."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in series:
        body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{body}}} {_format(value)}" if body else f"{name} {_format(value)}")
    return "\n".join(lines) + "\n"


def _labels(text: str) -> tuple[tuple[str, str], ...] | None:
    pairs = []
    position = 0
    while position < len(text):
        match = _LABEL.match(text, position)
        if match is None:
            return None if text[position:].strip() else tuple(pairs)
        value = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m[0]], match[2])
        pairs.append((match[1], value))
        position = match.end()
    return tuple(pairs)


def _number(text: str) -> float | None:
    try:
        return float(text)  # also reads NaN, +Inf, -Inf and 1.5e+06
    except ValueError:
        return None


def _format(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
