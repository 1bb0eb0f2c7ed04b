"""The sha256 of a file, read in chunks: the store's integrity records and the GGUF
conversion's source record both use it.

Knows: hashing. Must not know: anything else in specdeck (a leaf: imports only the standard
library).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 2**20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
