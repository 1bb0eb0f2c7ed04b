"""The history store: past prompts and replies (and seeded text), kept as token records on disk.

Knows: one file per tokenizer and partition, `SPECDECK_HOME/history/<tokenizer
digest>/<partition>.hist` (SPECDECK_HISTORY moves the folder): a JSON header line (format,
version, tokenizer digest, partition, counts, the body's sha256), then the body (record
lengths uint32, kinds uint8, tokens uint32, little-endian). The bounds (tokens per file,
bytes on disk for the whole history folder), eviction oldest first, atomic writes (temp
file, fsync, rename) under a file lock so two processes on one home (a UI and a server) lose
nothing, and setting aside a damaged or foreign file (renamed, with a message naming both
paths) so the app keeps running on an empty history. Partitions: one per API key (its hash,
never the key), `LOCAL` without keys. `History` is the live side: the store plus one suffix
index per partition (app/drafters/suffix.py), loaded on first use and swapped whole when a
reply is recorded.
Must not know: models, how drafts are made from the index, surfaces.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.core.engine import LOCAL_PARTITION
from app.drafters.suffix import SuffixIndex, index_of
from app.paths import home

FORMAT = "specdeck-history"
VERSION = 1
SUFFIX = ".hist"
SET_ASIDE = ".set-aside"
DEFAULT_MAX_TOKENS = 1_000_000
DEFAULT_MAX_BYTES = 256 * 2**20
# eviction goes down to this share of the bound, so a full history is rewritten (and its
# index rebuilt) once per tenth of the bound, not on every reply
LOW_WATER = 0.9
LOCAL = LOCAL_PARTITION  # the one partition without API keys
REPLY, SEEDED = "reply", "seeded"
KINDS = (REPLY, SEEDED)  # a record's kind is stored as its index here
LOCK_TIMEOUT_S = 30.0
# a reply is recorded with at most this much of its prompt before it: enough to match the
# question again, without each turn of a conversation storing every earlier turn once more
PROMPT_TAIL = 1024
_log = logging.getLogger("specdeck.history")


@dataclass(frozen=True)
class Record:
    """One recorded text: a request's prompt tail and reply, or a seeded file."""

    tokens: tuple[int, ...]
    kind: str = REPLY


@dataclass(frozen=True)
class Bounds:
    """How much history is kept: tokens per partition file, bytes of the history folder."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.max_bytes < 1:
            raise ValueError(f"history bounds must be positive (got {self})")


@dataclass(frozen=True)
class FileStats:
    """One partition file, as `specdeck cache stats` reports it."""

    tokenizer: str
    partition: str
    records: int
    tokens: int
    seeded_tokens: int
    bytes: int
    path: Path


class Damaged(Exception):
    """A history file that is not a readable history of this tokenizer and partition."""


def root() -> Path:
    """SPECDECK_HOME/history, or SPECDECK_HISTORY where it is set (a history kept apart)."""
    return Path(os.environ.get("SPECDECK_HISTORY") or home() / "history")


def tokenizer_digest(tokenizer: Any) -> str:
    """A short digest of a tokenizer's vocabulary: records are only meaningful to a tokenizer
    with the same ids, whatever the model is called or wherever it lies."""
    vocab = tokenizer.get_vocab()
    text = json.dumps(sorted(vocab.items(), key=lambda item: item[1]), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def partition_of(api_key: str | None) -> str:
    """The partition of an API key (a hash: the key itself is never written), LOCAL for none."""
    if not api_key:
        return LOCAL
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


class HistoryStore:
    """The records of one tokenizer, per partition, on disk; every write holds the file's lock."""

    def __init__(self, digest: str, folder: Path | None = None,
                 bounds: Bounds = Bounds()) -> None:
        self.digest = digest
        self.base = folder or root()
        self.folder = self.base / digest
        self.bounds = bounds
        self.notices: list[str] = []  # what was set aside, for the surfaces to show

    def path(self, partition: str) -> Path:
        return self.folder / f"{partition}{SUFFIX}"

    def load(self, partition: str) -> list[Record]:
        """The partition's records, oldest first; [] when none, or when its file was damaged
        or foreign (then set aside, with a message)."""
        path = self.path(partition)
        if not path.exists():
            return []
        with self._lock(partition):
            return self._read_or_set_aside(partition)

    def append(self, partition: str, records: Sequence[Record]) -> tuple[list[Record], int]:
        """Add records, evict the oldest past the bounds, write atomically: (the records now
        kept, oldest first; how many were evicted)."""
        records = [r for r in records if r.tokens]
        self.folder.mkdir(parents=True, exist_ok=True)
        with self._lock(partition):
            kept, evicted = self._evict([*self._read_or_set_aside(partition), *records])
            self._write(partition, kept)
        self._bound_folder(keep=self.path(partition))
        return kept, evicted

    def clear(self) -> int:
        """Remove every partition of this tokenizer; the number of files removed."""
        removed = 0
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            with self._lock(path.stem):
                path.unlink(missing_ok=True)
            removed += 1
        return removed

    def _lock(self, partition: str) -> Any:
        from filelock import FileLock

        self.folder.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.folder / f"{partition}.lock"), timeout=LOCK_TIMEOUT_S)

    def _read_or_set_aside(self, partition: str) -> list[Record]:
        path = self.path(partition)
        if not path.exists():
            return []
        try:
            return read(path, self.digest, partition)
        except Damaged as why:
            self._set_aside(path, str(why))
            return []

    def _set_aside(self, path: Path, why: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        aside = path.with_name(f"{path.name}{SET_ASIDE}-{stamp}-{os.getpid()}")
        os.replace(path, aside)
        notice = (f"history file {path} {why}: set aside as {aside}; starting an empty history "
                  "(delete the set-aside file once you no longer need it)")
        self.notices.append(notice)
        _log.warning(notice)

    def _evict(self, records: list[Record]) -> tuple[list[Record], int]:
        """Oldest first, down to LOW_WATER of a bound once a bound is passed (it drafted more
        than least used or least recently used in scripts/eviction_replay.py: a re-given reply
        is recorded again, so the old copies are the stale ones; docs/PERFORMANCE.md)."""
        tokens = sum(len(r.tokens) for r in records)
        size = body_bytes(records)
        if tokens <= self.bounds.max_tokens and size <= self.bounds.max_bytes:
            return records, 0
        token_goal = int(self.bounds.max_tokens * LOW_WATER)
        byte_goal = int(self.bounds.max_bytes * LOW_WATER)
        drop = 0
        while drop < len(records) and (tokens > token_goal or size > byte_goal):
            tokens -= len(records[drop].tokens)
            size -= body_bytes(records[drop:drop + 1])
            drop += 1
        return records[drop:], drop

    def _write(self, partition: str, records: list[Record]) -> None:
        path = self.path(partition)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as out:
            out.write(encode(records, self.digest, partition))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
        _fsync_folder(path.parent)

    def _bound_folder(self, keep: Path) -> None:
        """The byte bound over every tokenizer's files: whole files, least recently written
        first, never the one just written (its own bound holds it)."""
        files = sorted(self.base.glob(f"*/*{SUFFIX}"), key=_mtime)
        total = sum(_size(p) for p in files)
        for path in files:
            if total <= self.bounds.max_bytes:
                break
            if path != keep:
                total -= _size(path)
                path.unlink(missing_ok=True)


class History:
    """One tokenizer's history, live: records on disk, an index per partition in memory.

    A recorded reply enters the partition's index at once (the next request drafts from
    it) and the disk on a thread of its own: a full history's file takes tens of
    milliseconds to rewrite, which no reply waits for. `flush` waits for the disk."""

    def __init__(self, store: HistoryStore, prompt_tail: int = PROMPT_TAIL) -> None:
        self.store = store
        self.prompt_tail = prompt_tail
        self._indexes: dict[str, SuffixIndex] = {}
        self._unwritten: dict[str, list[Record]] = {}  # in the index, not yet on disk
        self._lock = threading.RLock()
        self._queue: queue.Queue[tuple[str, Record]] = queue.Queue()
        self._writer: threading.Thread | None = None

    @property
    def folder(self) -> Path:
        return self.store.folder

    def index(self, partition: str) -> SuffixIndex:
        """The partition's index as it is now (an immutable snapshot)."""
        found = self._indexes.get(partition)
        if found is None:
            with self._lock:
                found = self._indexes.get(partition)
                if found is None:
                    found = self._indexes[partition] = index_of(self.store.load(partition))
        return found

    def record(self, partition: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """A finished reply, after the tail of its prompt (the reply follows that text)."""
        tokens = (*prompt[len(prompt) - min(len(prompt), self.prompt_tail):], *output)
        record = Record(tuple(int(t) for t in tokens), REPLY)
        with self._lock:
            self._indexes[partition] = self.index(partition).added([(record.tokens, False)])
            self._unwritten.setdefault(partition, []).append(record)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_forever,
                                                name="history-writer", daemon=True)
                self._writer.start()
                atexit.register(self.flush)
        self._queue.put((partition, record))

    def add(self, partition: str, records: Sequence[Record]) -> None:
        """Records written now (seeds, tests), then indexed."""
        self.flush()
        with self._lock:
            kept, _ = self.store.append(partition, records)
            self._indexes[partition] = index_of(kept)

    def flush(self) -> None:
        """Wait until every recorded reply is on disk."""
        if self._writer is not None:
            self._queue.join()

    def tokens(self, partition: str) -> int:
        return self.index(partition).n_tokens

    def memory_tokens(self) -> int:
        """Tokens indexed in memory, over the partitions loaded."""
        return sum(index.n_tokens for index in tuple(self._indexes.values()))

    def forget(self) -> None:
        """Drop what is in memory (the files are being cleared): later replies start afresh."""
        self.flush()
        with self._lock:
            self._indexes.clear()

    def _write_forever(self) -> None:
        while True:
            partition, record = self._queue.get()
            try:
                self._write(partition, record)
            except Exception as error:  # noqa: BLE001 - a reply must never fail on its history
                _log.warning(f"history not written to {self.store.path(partition)}: {error}")
            finally:
                self._queue.task_done()

    def _write(self, partition: str, record: Record) -> None:
        kept, evicted = self.store.append(partition, [record])
        with self._lock:
            unwritten = self._unwritten[partition]
            unwritten.remove(record)
            index = self._indexes[partition]
            if evicted or len(index.record_starts) != len(kept) + len(unwritten):
                # evicted, or another process wrote too: index what the file holds
                self._indexes[partition] = index_of([*kept, *unwritten])


def open_history(tokenizer: Any, bounds: Bounds = Bounds()) -> History:
    """The history of a target's tokenizer under SPECDECK_HOME."""
    return History(HistoryStore(tokenizer_digest(tokenizer), bounds=bounds))


def body_bytes(records: Sequence[Record]) -> int:
    return sum(5 + 4 * len(r.tokens) for r in records)  # length, kind, tokens


def encode(records: Sequence[Record], digest: str, partition: str) -> bytes:
    lengths = np.array([len(r.tokens) for r in records], dtype="<u4")
    kinds = np.array([KINDS.index(r.kind) for r in records], dtype="u1")
    tokens = np.fromiter((t for r in records for t in r.tokens), dtype="<u4",
                         count=int(lengths.sum()))
    body = lengths.tobytes() + kinds.tobytes() + tokens.tobytes()
    header = {"format": FORMAT, "version": VERSION, "tokenizer": digest,
              "partition": partition, "records": len(records), "tokens": int(lengths.sum()),
              "sha256": hashlib.sha256(body).hexdigest()}
    return json.dumps(header).encode() + b"\n" + body


def read(path: Path, digest: str, partition: str) -> list[Record]:
    """A file's records; Damaged (naming what is wrong) when it is not this tokenizer's and
    partition's history of this version, or its body does not match its checksum."""
    data = path.read_bytes()
    line, _, body = data.partition(b"\n")
    try:
        header = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise Damaged("is not a specdeck history file")
    expected = {"version": VERSION, "tokenizer": digest, "partition": partition}
    for field, value in expected.items():
        if header.get(field) != value:
            raise Damaged(f"is foreign: its {field} is {header.get(field)!r}, not {value!r}")
    n, total = header.get("records"), header.get("tokens")
    if not isinstance(n, int) or not isinstance(total, int) or len(body) != 5 * n + 4 * total \
            or hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise Damaged("is damaged: its contents do not match its checksum")
    lengths = np.frombuffer(body, dtype="<u4", count=n)
    kinds = np.frombuffer(body, dtype="u1", count=n, offset=4 * n)
    tokens = np.frombuffer(body, dtype="<u4", count=total, offset=5 * n)
    if int(lengths.sum()) != total or (n and int(kinds.max()) >= len(KINDS)):
        raise Damaged("is damaged: its record table does not add up")
    ends = np.cumsum(lengths)
    return [Record(tuple(tokens[end - length:end].tolist()), KINDS[kind])
            for length, kind, end in zip(lengths.tolist(), kinds.tolist(), ends.tolist())]


def stats(folder: Path | None = None) -> list[FileStats]:
    """Every partition file under the history folder, readable or not (a damaged one counts
    its bytes, and no records)."""
    base = folder or root()
    out = []
    for path in sorted(base.glob(f"*/*{SUFFIX}")):
        digest, partition = path.parent.name, path.stem
        try:
            records = read(path, digest, partition)
        except (Damaged, OSError):
            records = []
        out.append(FileStats(digest, partition, len(records),
                             sum(len(r.tokens) for r in records),
                             sum(len(r.tokens) for r in records if r.kind == SEEDED),
                             _size(path), path))
    return out


def clear_all(folder: Path | None = None) -> int:
    """Remove the whole history folder (every tokenizer, partition and set-aside file); the
    number of history files it held."""
    base = folder or root()
    count = len(list(base.glob(f"*/*{SUFFIX}")))
    shutil.rmtree(base, ignore_errors=True)
    return count


def seed_records(token_lists: Iterable[Sequence[int]]) -> list[Record]:
    return [Record(tuple(int(t) for t in tokens), SEEDED) for tokens in token_lists if tokens]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _fsync_folder(folder: Path) -> None:
    # the rename itself survives a power cut only once its folder is synced (POSIX)
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
