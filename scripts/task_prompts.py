"""General-task prompts for `specdeck train-head`, made from the prose of the Python standard
library's docstrings and from arithmetic word problems with random numbers.

Usage: python scripts/task_prompts.py OUT.jsonl [--limit 2000] [--seed 0]

A head for a chat model must see the kinds of request its benchmarks ask (spec-bench:
summaries, translation, questions, maths, writing), and no bundled set may be trained on. The
standard library's docstrings are English prose on every machine, licensed for this; each
paragraph of two or more sentences becomes two tasks (summarise, translate, explain, ask
questions about it, rewrite), and word problems are drawn from templates. Writes
{"prompt": ...} lines, as `--prompts` reads.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import re
from pathlib import Path

from code_prompts import imported  # scripts/ is this script's import path

TASKS = (
    "Summarize the following text in one or two sentences.\n\n{text}",
    "Translate the following text into German.\n\n{text}",
    "Translate the following text into French.\n\n{text}",
    "Explain the following passage to someone who is new to programming.\n\n{text}",
    "Write three questions that the following text answers, each with its answer.\n\n{text}",
    "Rewrite the following text so that it is shorter and easier to read.\n\n{text}",
    "Read the text below, then say what it is for and when one would use it.\n\n{text}",
)
PROBLEMS = (
    "A shop sells {a} notebooks for ${b} each and {c} pens for ${d} each. How much does a "
    "customer pay for all of them? Explain your reasoning step by step.",
    "A train travels {a} kilometres in {b} hours, then {c} kilometres in {d} hours. What is "
    "its average speed over the whole trip? Show your work.",
    "Maria has {a} apples. She gives {b} to her brother and buys {c} bags with {d} apples "
    "each. How many apples does she have now? Think step by step.",
    "A class of {a} students is split into groups of {d}. {b} students are absent. How many "
    "full groups can be formed, and how many students are left over? Explain.",
    "A recipe needs {b} grams of flour for {d} people. How much flour is needed for {a} "
    "people? Give the answer and the steps.",
)


def paragraphs() -> list[str]:
    """Prose paragraphs (two or more sentences, no code) of stdlib module and function
    docstrings."""
    found: list[str] = []
    for name, module in imported():
        docs = [inspect.getdoc(module)] + [inspect.getdoc(f) for f in _members(module, name)]
        for doc in filter(None, docs):
            found += [p for p in _split(doc) if _is_prose(p)]
    return list(dict.fromkeys(found))


def _members(module: object, name: str) -> list[object]:
    """The module's own public functions and classes, and the classes' own methods."""
    own = [m for n, m in inspect.getmembers(module)
           if not n.startswith("_") and (inspect.isfunction(m) or inspect.isclass(m))
           and getattr(m, "__module__", None) == name]
    methods = [f for c in own if inspect.isclass(c) for n, f in vars(c).items()
               if not n.startswith("_") and inspect.isfunction(f)]
    return own + methods


def _split(doc: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc)]


def _is_prose(text: str) -> bool:
    sentences = re.findall(r"[a-z][.!?](\s|$)", text)
    code = re.search(r">>>|::|[{}\[\]=]|\w\(|^\s*-", text)
    return len(sentences) >= 2 and not code and 120 <= len(text) <= 900


def problem(rng: random.Random) -> str:
    a, b, c, d = (rng.randint(2, 60) for _ in range(4))
    return rng.choice(PROBLEMS).format(a=a, b=b, c=c, d=d)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--limit", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    texts = paragraphs()
    # two different tasks per paragraph: one text, two kinds of answer
    prompts = [task.format(text=t) for t in texts for task in rng.sample(TASKS, 2)]
    prompts += [problem(rng) for _ in range(max(len(prompts) // 6, 1))]
    rng.shuffle(prompts)
    prompts = prompts[:args.limit]
    with args.out.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"{len(prompts)} prompts ({len(texts)} stdlib paragraphs) written to {args.out}")


if __name__ == "__main__":
    main()
