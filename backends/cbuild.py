"""Building the project's C kernels: once per machine, cached, never half-written.

Knows: the system C compiler (CC, else cc or gcc), the cache folder for build artifacts.
Must not know: what the kernels compute. w4a8.py, kquant.py and ggml.py load what it builds.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def cache_dir() -> Path:
    # a build artifact of this machine, not user data: shared by every SPECDECK_HOME
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "specdeck" / "kernels"


def build(name: str, source: Path, flags: Sequence[str], link: Sequence[str] = (),
          key: bytes = b"") -> ctypes.CDLL:
    """The shared library of source, built on first use into the cache under a name hashed
    from the source, the flags and key (what else the build depends on); built beside its
    final name and renamed, so a half-written library never loads. Raises OSError or
    CalledProcessError when it cannot build."""
    digest = hashlib.sha256(source.read_bytes() + " ".join([*flags, *link]).encode() + key)
    target = cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        cc = compiler()
        if cc is None:
            raise OSError("no C compiler (cc or gcc) on PATH")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([cc, *flags, str(source), "-o", str(built), *link],
                           check=True, capture_output=True, text=True)
            os.replace(built, target)
    return ctypes.CDLL(str(target))


def loads(library: Callable[[], ctypes.CDLL]) -> bool:
    """Whether library() builds and loads here (a kernel's is_available, past its CPU check)."""
    try:
        library()
    except (OSError, subprocess.CalledProcessError):
        return False
    return True
