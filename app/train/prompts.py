"""Prompts a head is trained on: bundled sets, JSONL and text files; kept apart from benchmarks.

Knows: the prompt sources (a bundled bench set by name, a JSONL file as `specdeck bench` reads
it, a .txt file with one prompt per line), which prompts the bundled bench sets hold (a
file's prompt that a bundled benchmark also uses is dropped; a bundled set asked for by name
is used whole), and the
prompts.jsonl written next to a head so a benchmark can leave those prompts out. Must not
know: models, array libraries.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.bench.prompts import PROMPT_SETS, BenchPrompt, load_prompts
from app.core.types import SpecdeckError

PROMPTS_FILE = "prompts.jsonl"


@dataclass(frozen=True)
class TrainingPrompts:
    prompts: tuple[BenchPrompt, ...]
    dropped_bench: int  # prompts left out because a bundled benchmark uses them


def collect(specs: Sequence[str], limit: int | None = None) -> TrainingPrompts:
    """Every prompt of the sources, each text once, in order; at most `limit`."""
    if not specs:
        raise SpecdeckError("give prompts to train on with --prompts: a bundled set ("
                            f"{', '.join(PROMPT_SETS)}), a JSONL file or a .txt file with one "
                            "prompt per line (repeatable)")
    bench = {p.text.strip() for name in PROMPT_SETS for p in load_prompts(name)}
    seen: set[str] = set()
    kept: list[BenchPrompt] = []
    dropped = 0
    for spec in specs:
        asked_for_bench = spec.partition(":")[0] in PROMPT_SETS
        for p in _read(spec):
            text = p.text.strip()
            if text in seen:
                continue
            seen.add(text)
            if text in bench and not asked_for_bench:
                dropped += 1
                continue
            kept.append(p)
    if limit is not None:
        if limit < 1:
            raise SpecdeckError(f"--limit must be >= 1 (got {limit})")
        kept = kept[:limit]
    if not kept:
        raise SpecdeckError(f"no prompts left in {', '.join(specs)} ({dropped} are in a bundled "
                            "benchmark): give other prompts")
    return TrainingPrompts(tuple(kept), dropped)


def _read(spec: str) -> list[BenchPrompt]:
    path = Path(spec)
    if path.suffix == ".txt" and path.is_file():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise SpecdeckError(f"could not read prompts from {path}: {error}") from error
        return [BenchPrompt(f"{path.name}:{n}", path.stem, line)
                for n, line in enumerate(lines, start=1) if line.strip()]
    return load_prompts(spec)


def trained_on(folder: str | Path | None) -> frozenset[str]:
    """The prompt texts a head folder says it was trained on (none for a published head)."""
    if folder is None or not (Path(folder) / PROMPTS_FILE).is_file():
        return frozenset()
    return frozenset(p.text.strip() for p in _read(str(Path(folder) / PROMPTS_FILE)))


def write(folder: Path, prompts: Sequence[BenchPrompt]) -> Path:
    """prompts.jsonl next to the head: the texts it was trained on (benchmarks skip them)."""
    path = folder / PROMPTS_FILE
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"id": p.id, "category": p.category, "prompt": p.text},
                               ensure_ascii=False) + "\n")
    return path
