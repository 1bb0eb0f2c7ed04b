"""Code prompts for `specdeck train-head`, made from the Python standard library's own functions.

Usage: python scripts/code_prompts.py OUT.jsonl [--limit 400] [--seed 0]

A head for a code model learns best from code, and no bundled set may be trained on (they are
the benchmarks). The standard library is on every machine and licensed for this: each public
function, and each public method of a public class, with a docstring of two or more lines
becomes a HumanEval-style prompt (its signature and docstring, the body to write). Functions
named like a HumanEval task are left out, so the head never sees a benchmark's signature.
Writes {"prompt": ...} lines, as `--prompts` reads.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import pkgutil
import random
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

SKIP_PREFIXES = ("test", "idlelib", "tkinter", "turtle", "ensurepip", "lib2to3", "pydoc_data",
                 "antigravity", "this", "__")
HUMANEVAL = Path("/work/shared/data/prompts/HumanEval.jsonl.gz")


def humaneval_names() -> set[str]:
    if not HUMANEVAL.exists():
        return set()
    with gzip.open(HUMANEVAL, "rt") as f:
        return {json.loads(line)["entry_point"] for line in f}


def modules() -> list[str]:
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names)
    return [n for n in names if not n.startswith(SKIP_PREFIXES)]


def imported() -> Iterator[tuple[str, ModuleType]]:
    """(name, module) for each standard-library module that imports on this machine."""
    for module_name in modules():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except Exception:  # noqa: BLE001 - platform-only modules fail to import
                continue
        yield module_name, module


def prompt_for(name: str, function: object) -> str | None:
    doc = inspect.getdoc(function)
    if not doc or len(doc.strip().splitlines()) < 2 or len(doc) > 1200:
        return None
    try:
        signature = str(inspect.signature(function))
    except (TypeError, ValueError):
        return None
    if "=<" in signature:  # a default printed as <object at 0x...>: not Python, not repeatable
        return None
    body = "\n".join(f"    {line}" if line else "" for line in doc.splitlines())
    return f'def {name}{signature}:\n    """\n{body}\n    """\n'


def collect(exclude: set[str]) -> list[str]:
    prompts: list[str] = []
    for module_name, module in imported():
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("_") or name in exclude or function.__module__ != module_name:
                continue
            text = prompt_for(name, function)
            if text:
                prompts.append(text)
        prompts += _method_prompts(module, module_name, exclude)
    return prompts


def _method_prompts(module: object, module_name: str, exclude: set[str]) -> list[str]:
    """Public methods of the module's own public classes, written as plain functions (their
    `self` kept): more code to learn from than the module-level functions alone."""
    prompts = []
    for class_name, cls in inspect.getmembers(module, inspect.isclass):
        if class_name.startswith("_") or getattr(cls, "__module__", None) != module_name:
            continue
        for name, method in vars(cls).items():
            if name.startswith("_") or name in exclude or not inspect.isfunction(method):
                continue
            text = prompt_for(name, method)
            if text:
                prompts.append(text)
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = list(dict.fromkeys(collect(humaneval_names())))  # re-exported names repeat
    random.Random(args.seed).shuffle(prompts)
    chosen = prompts[:args.limit]
    with open(args.out, "w") as f:
        for text in chosen:
            f.write(json.dumps({"prompt": text}) + "\n")
    print(f"{len(chosen)} of {len(prompts)} stdlib functions and methods written to {args.out}")


if __name__ == "__main__":
    main()
