"""What each installed file was at install (size, mtime, sha256), and whether it still is.

Knows: hashing and stat. Must not know: the catalogue, sources, the folder layout (callers
pass a folder and its records).

The cheap check compares size and mtime and rehashes a file only when one of them changed,
so every load can afford it; the full check (`specdeck pull --verify`) rehashes every file.
A rehash that matches refreshes the record's mtime, so a touched file costs one hash, once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from backends.digest import sha256_of

UNKNOWN = -1  # a size/mtime no file has: forces a rehash (records adopted from old markers)


@dataclass(frozen=True)
class FileRecord:
    name: str  # relative to the model's folder
    size: int
    mtime_ns: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "mtime_ns": self.mtime_ns, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> FileRecord:
        return cls(name, int(data["size"]), int(data["mtime_ns"]), str(data["sha256"]))


@dataclass(frozen=True)
class Check:
    records: tuple[FileRecord, ...]  # every record, mtimes refreshed where a rehash matched
    bad: tuple[str, ...]  # files missing, or whose sha256 differs from the record
    rehashed: int  # how many files were hashed

    @property
    def ok(self) -> bool:
        return not self.bad


def record(folder: Path, name: str, sha256: str | None = None) -> FileRecord:
    """The record of folder/name as it is now; sha256 when already known (verified on the way
    in), else hashed here."""
    path = folder / name
    st = path.stat()
    return FileRecord(name, st.st_size, st.st_mtime_ns, sha256 or sha256_of(path))


def check(folder: Path, records: tuple[FileRecord, ...], full: bool = False) -> Check:
    """Compare the files under folder with their records (full: rehash every one)."""
    kept, bad, rehashed = [], [], 0
    for rec in records:
        path = folder / rec.name
        try:
            st = path.stat()
        except OSError:
            bad.append(rec.name)
            kept.append(rec)
            continue
        if not full and st.st_size == rec.size and st.st_mtime_ns == rec.mtime_ns:
            kept.append(rec)
            continue
        rehashed += 1
        if st.st_size != rec.size and rec.size != UNKNOWN or sha256_of(path) != rec.sha256:
            bad.append(rec.name)
            kept.append(rec)
        else:
            kept.append(replace(rec, size=st.st_size, mtime_ns=st.st_mtime_ns))
    return Check(tuple(kept), tuple(bad), rehashed)
