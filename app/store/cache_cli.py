"""`specdeck cache build|stats|clear`: the history the suffix drafter drafts from, by hand.

Knows: the command's flags, which files of a folder are text worth seeding (UTF-8, no NUL
bytes, not too large, outside VCS and dependency folders), how a target is named (a
catalogue pair id, an HF folder or a .gguf, default the pair used last: its tokenizer keys
the history), and how to print the store's statistics. Must not know: the file format
(app/store/history.py), drafting.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.types import SpecdeckError
from app.flags import add_history_bounds
from app.store import history

SKIPPED_FOLDERS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv",
                             "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache", "dist",
                             "build", ".tox", ".idea", ".vscode"})
MAX_FILE_BYTES = 1 << 20  # larger files are data or generated, rarely what a user retypes


@dataclass(frozen=True)
class Seeded:
    files: int
    skipped: int
    tokens: int
    evicted: int
    full: bool  # stopped reading at the token bound
    path: Path


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser("cache", help="the history drafts come from: build, stats, clear")
    actions = p.add_subparsers(metavar="ACTION")
    build = actions.add_parser("build", help="seed the history from a folder of text or code")
    build.add_argument("--from", dest="source", required=True,
                       help="a folder (or one file) of text or code, e.g. your repository")
    build.add_argument("--target", help="the pair id, HF folder or .gguf whose tokenizer "
                                        "reads it (default: the pair used last)")
    build.add_argument("--backend", default="auto", help="the backend that loads --target")
    add_history_bounds(build)
    build.set_defaults(handler=_build)
    stats = actions.add_parser("stats", help="what the history holds, per tokenizer and "
                                             "partition, and where")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(handler=_stats)
    clear = actions.add_parser("clear", help="delete the whole history (every partition)")
    clear.set_defaults(handler=_clear)
    p.set_defaults(handler=lambda args: p.print_help() or 2)


def bounds_of(args: argparse.Namespace) -> history.Bounds:
    try:
        return history.Bounds(getattr(args, "history_max_tokens", history.DEFAULT_MAX_TOKENS),
                              getattr(args, "history_max_bytes", history.DEFAULT_MAX_BYTES))
    except ValueError:
        raise SpecdeckError("--history-max-tokens and --history-max-bytes must be positive"
                            ) from None


def text_files(source: Path) -> Iterator[Path]:
    """The files under source a user may have written, in a stable order."""
    if source.is_file():
        yield source
        return
    for path in sorted(source.rglob("*")):
        parts = path.relative_to(source).parts
        if path.is_file() and not any(p in SKIPPED_FOLDERS for p in parts[:-1]):
            yield path


def file_text(path: Path) -> str | None:
    """The file as text, or None when it is not text worth seeding."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() and "\x00" not in text else None


def seed(store: history.HistoryStore, tokenizer: Any, source: Path) -> Seeded:
    """Every text file under source, tokenized, as seeded records of the local partition."""
    token_lists, files, skipped, total, full = [], 0, 0, 0, False
    for path in text_files(source):
        text = file_text(path)
        if text is None:
            skipped += 1
            continue
        if total >= store.bounds.max_tokens:
            full = True
            break
        ids = tokenizer.encode(text, add_special_tokens=False)
        token_lists.append(ids)
        files += 1
        total += len(ids)
    _, evicted = store.append(history.LOCAL, history.seed_records(token_lists))
    return Seeded(files, skipped, total, evicted, full, store.path(history.LOCAL))


def _build(args: argparse.Namespace) -> int:
    source = Path(args.source).expanduser()
    if not source.exists():
        raise SpecdeckError(f"{source} does not exist: give --from a folder or file of text")
    tokenizer, name = _tokenizer(args.target, args.backend)
    store = history.HistoryStore(history.tokenizer_digest(tokenizer), bounds=bounds_of(args))
    done = seed(store, tokenizer, source)
    print(f"seeded {done.tokens} tokens from {done.files} files of {source} "
          f"({done.skipped} skipped: not text, empty or over {MAX_FILE_BYTES >> 20} MB) "
          f"for {name}'s tokenizer into {done.path}")
    if done.full or done.evicted:
        print(f"the history is bounded at {store.bounds.max_tokens} tokens: "
              f"{'reading stopped there; ' if done.full else ''}"
              f"{done.evicted} oldest records evicted (--history-max-tokens raises it)")
    return 0


def _tokenizer(target: str | None, backend: str) -> tuple[Any, str]:
    """The tokenizer of the target as the surfaces load it (a pair id, a folder, a .gguf)."""
    from dataclasses import replace

    from app.pair import LoadSpec, Pair
    from app.store import recent

    target = target or recent.last_pair()
    if not target:
        raise SpecdeckError("name the model whose tokenizer reads the files: --target PAIR "
                            "(a pair id from `specdeck models`), an HF folder or a .gguf")
    spec = replace(LoadSpec(target, backend=backend, device="cpu").resolved(), draft=None)
    model = Pair.open(spec).target
    return model.tokenizer, target


def _stats(args: argparse.Namespace) -> int:
    found = history.stats()
    if args.json:
        print(json.dumps({"folder": str(history.root()), "files": [
            {"tokenizer": s.tokenizer, "partition": s.partition, "records": s.records,
             "tokens": s.tokens, "seeded_tokens": s.seeded_tokens, "bytes": s.bytes,
             "path": str(s.path)} for s in found],
            "tokens": sum(s.tokens for s in found), "bytes": sum(s.bytes for s in found)}))
        return 0
    if not found:
        print(f"the history is empty ({history.root()})")
        return 0
    for s in found:
        print(f"{s.tokenizer}/{s.partition}: {s.records} records, {s.tokens} tokens "
              f"({s.seeded_tokens} seeded), {s.bytes / 2**20:.1f} MB  {s.path}")
    print(f"total: {sum(s.tokens for s in found)} tokens, "
          f"{sum(s.bytes for s in found) / 2**20:.1f} MB in {history.root()}",
          file=sys.stdout)
    return 0


def _clear(args: argparse.Namespace) -> int:
    removed = history.clear_all()
    print(f"cleared the history: {removed} files removed from {history.root()}")
    return 0
