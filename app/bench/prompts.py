"""Prompt sets for `specdeck bench`: the bundled ones (assets/prompts/) and JSONL files.

Knows: the bundled files, their fields and categories (Spec-Bench, its MT-bench part,
HumanEval and a code-rewrite task built from it). Must not know: models or measurements.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.catalogue.shipped import shipped_path
from app.core.types import SpecdeckError

ASSETS = shipped_path("assets/prompts")
PROMPT_SETS = ("spec-bench", "mt-bench", "humaneval", "humaneval-rewrite")
MT_BENCH_LABELS = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                             "stem", "humanities"})


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str



def load_prompts(spec: str, limit: int | None = None,
                 exclude: frozenset[str] = frozenset()) -> list[BenchPrompt]:
    """A bundled set (NAME or NAME:cat1,cat2) or a JSONL file; the first `limit` per category
    among the prompts whose text is not in `exclude` (a head's training prompts)."""
    name, _, wanted = spec.partition(":")
    if name in PROMPT_SETS:
        prompts = _bundled(name)
    elif Path(spec).is_file():
        name, wanted, prompts = spec, "", _jsonl_file(Path(spec))
    else:
        raise SpecdeckError(f"unknown prompt set {spec!r}: use one of {', '.join(PROMPT_SETS)} "
                            "(optionally NAME:category,...) or a path to a JSONL file")
    if wanted:
        keep = {c.strip() for c in wanted.split(",") if c.strip()}
        known = {p.category for p in prompts}
        if keep - known:
            raise SpecdeckError(f"{name} has no category {sorted(keep - known)}: "
                                f"pick from {', '.join(sorted(known))}")
        prompts = [p for p in prompts if p.category in keep]
    if exclude:
        prompts = [p for p in prompts if p.text.strip() not in exclude]
    if limit is not None:
        if limit < 1:
            raise SpecdeckError(f"--limit must be >= 1 (got {limit})")
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= limit:
                kept.append(p)
        prompts = kept
    if not prompts:
        why = " once the head's training prompts are left out" if exclude else ""
        raise SpecdeckError(f"the prompt set {spec} is empty{why}")
    return prompts


def _bundled(name: str) -> list[BenchPrompt]:
    if name in ("spec-bench", "mt-bench"):
        rows = _read_jsonl(ASSETS / "spec_bench_question.jsonl.gz")
        if name == "mt-bench":
            return [BenchPrompt(str(r["question_id"]), r["category"], r["turns"][0])
                    for r in rows if r["category"] in MT_BENCH_LABELS]
        # Spec-Bench's evaluation groups the eight MT-bench labels into one task group
        return [BenchPrompt(str(r["question_id"]),
                            "mt_bench" if r["category"] in MT_BENCH_LABELS else r["category"],
                            r["turns"][0]) for r in rows]
    rows = _read_jsonl(ASSETS / "HumanEval.jsonl.gz")
    if name == "humaneval":
        return [BenchPrompt(r["task_id"], "humaneval", r["prompt"]) for r in rows]
    return [BenchPrompt(r["task_id"] + "/rewrite", "code_rewrite", _rewrite_request(r))
            for r in rows]


def _rewrite_request(row: dict[str, Any]) -> str:
    code = row["prompt"] + row["canonical_solution"]
    return ("Rewrite the following Python function so that it is easier to read: keep its "
            "behaviour and its docstring, use clear variable names, and reply with the whole "
            f"function only.\n\n```python\n{code}```\n")


def _jsonl_file(path: Path) -> list[BenchPrompt]:
    prompts = []
    for n, row in enumerate(_read_jsonl(path), start=1):
        text = row.get("prompt") or row.get("text") or row.get("question")
        if not text and row.get("turns"):
            text = row["turns"][0]
        if not isinstance(text, str) or not text.strip():
            raise SpecdeckError(f"{path} line {n} has no prompt: give each line a \"prompt\" "
                                "(or \"text\", \"question\", \"turns\") string")
        ident = row.get("id", row.get("question_id", row.get("task_id", n)))
        prompts.append(BenchPrompt(str(ident), str(row.get("category", "prompts")), text))
    return prompts


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as error:
        raise SpecdeckError(f"could not read prompts from {path}: {error}. Give a JSONL file "
                            "with one JSON object per line") from error
