"""Files of a Hugging Face hub repo, fetched through huggingface_hub and verified.

Knows: HF_ENDPOINT / HF_HUB_OFFLINE, the repo tree listing (sizes, LFS sha256, git hashes),
hf_hub_download into a staging folder (its in-run resume with Range requests), and the hub's
errors turned into fixes. Must not know: the catalogue's pairs, the final layout.
Files that finished before an interruption stay staged and verified, so the next run
fetches only the rest; huggingface_hub >= 1.0 drops a partly downloaded file itself.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.catalogue.registry import HubSource
from app.core.types import SpecdeckError
from app.store.pull_progress import Reporter

PROBE_TIMEOUT_S = 5.0
CHUNK = 2**20


class HubUnavailable(SpecdeckError):
    """The hub cannot serve this source now (offline, 404, gated); the mirror may."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # LFS files: the sha256 of the content
    git_sha1: str | None  # small files: git's blob hash


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def reachable(url: str, repo: str) -> tuple[bool, str]:
    """One short request: any HTTP answer means reachable (huggingface_hub's own retries
    would take ~25 s to say the same)."""
    for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(flag, "").strip().lower() in ("1", "true", "yes", "on"):
            return False, f"{flag} is set"
    request = urllib.request.Request(f"{url}/api/models/{repo}", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S):
            return True, ""
    except urllib.error.HTTPError:
        return True, ""
    except (urllib.error.URLError, OSError) as error:
        return False, str(getattr(error, "reason", error))


def list_files(source: HubSource) -> list[RemoteFile]:
    """The source's files with their sizes and hashes; HubUnavailable when it cannot."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    url = endpoint()
    ok, why = reachable(url, source.repo)
    if not ok:
        raise HubUnavailable(f"the hub ({url}) is unreachable: {why}")
    with hub_errors(source):
        entries = {e.path: e for e in HfApi(endpoint=url).list_repo_tree(
            source.repo, revision=source.revision, recursive=True) if isinstance(e, RepoFile)}
    if source.files:
        missing = [f for f in source.files if f not in entries]
        if missing:
            raise HubUnavailable(f"{missing[0]} is not in {source.repo}@{source.revision} "
                                 "(404): the catalogue entry needs fixing")
        names = list(source.files)
    else:
        names = list(filter_repo_objects(sorted(entries), allow_patterns=source.allow_patterns))
        if not names:
            raise HubUnavailable(f"no file of {source.repo} matches "
                                 f"{list(source.allow_patterns)}: the catalogue entry needs "
                                 "fixing")
    return [RemoteFile(n, entries[n].size, entries[n].lfs.sha256 if entries[n].lfs else None,
                       None if entries[n].lfs else entries[n].blob_id) for n in names]


def remaining_bytes(files: list[RemoteFile], staging: Path) -> int:
    return sum(f.size for f in files if not staged_ok(staging / f.name, f))


def fetch(model_id: str, source: HubSource, files: list[RemoteFile], staging: Path,
          report: Reporter) -> list[tuple[Path, str, str | None]]:
    """Download what is not staged yet; verify each file. Returns (staged path, name, sha256
    when the hub lists it: LFS files; small files are hashed at install)."""
    from huggingface_hub import hf_hub_download

    staged = []
    for remote in files:
        path = staging / remote.name
        if not staged_ok(path, remote):
            with hub_errors(source):
                hf_hub_download(source.repo, remote.name, revision=source.revision,
                                local_dir=staging, endpoint=endpoint(),
                                tqdm_class=_bar_class(report, model_id, remote.name))
            verify(path, remote)
        staged.append((path, remote.name, remote.sha256))
    return staged


@contextmanager
def hub_errors(source: HubSource) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into messages that name the fix."""
    from huggingface_hub import errors

    repo = source.repo
    try:
        yield
    except SpecdeckError:
        raise
    except errors.GatedRepoError as error:
        raise HubUnavailable(f"{repo} is gated: accept its license on "
                             f"https://huggingface.co/{repo} and log in with `hf auth login`"
                             ) from error
    except errors.RepositoryNotFoundError as error:
        raise HubUnavailable(f"{repo} was not found on the hub (404): check the id in "
                             "models.yaml, or log in if it is private") from error
    except errors.RevisionNotFoundError as error:
        raise HubUnavailable(f"revision {source.revision} of {repo} was not found (404)"
                             ) from error
    except errors.EntryNotFoundError as error:
        raise HubUnavailable(f"a file of {repo} was not found (404)") from error
    except errors.HfHubHTTPError as error:
        raise HubUnavailable(f"the hub answered an error for {repo}: {error}") from error
    except Exception as error:
        if _is_network_error(error):
            raise HubUnavailable(f"the hub connection failed ({error}); run the pull again "
                                 "to resume") from error
        raise


def _is_network_error(error: BaseException) -> bool:
    names = {c.__name__ for c in type(error).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "NetworkError", "TransportError",
                         "ConnectionError", "RemoteProtocolError"})


def staged_ok(path: Path, remote: RemoteFile) -> bool:
    """A staged file from an earlier, interrupted pull that is complete and verified."""
    if not path.is_file() or path.stat().st_size != remote.size:
        return False
    try:
        verify(path, remote)
    except SpecdeckError:
        return False
    return True


def verify(path: Path, remote: RemoteFile) -> None:
    """sha256 for LFS files, git's blob hash for small ones; a mismatch deletes the file."""
    if remote.sha256:
        check_digest(path, "sha256", remote.sha256, hashlib.sha256())
    elif remote.git_sha1:
        digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
        check_digest(path, "git hash", remote.git_sha1, digest)


def check_digest(path: Path, label: str, expected: str, digest: Any) -> None:
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        path.unlink(missing_ok=True)
        raise SpecdeckError(f"checksum mismatch for {path.name} ({label} {digest.hexdigest()[:12]}"
                            f"… instead of {expected[:12]}…): the bad file was removed. Run the "
                            "pull again; if it repeats, the source changed and models.yaml "
                            "needs updating")


def _bar_class(report: Reporter, model_id: str, name: str) -> Any:
    """A tqdm stand-in for huggingface_hub that forwards byte counts to the reporter."""

    class Bar:
        def __init__(self, *args: Any, total: int | None = None, initial: int = 0,
                     **kwargs: Any) -> None:
            self.total, self.n = total or 0, initial

        def update(self, n: int = 1) -> None:
            self.n += n
            report.chunk(model_id, name, n, self.n, self.total)

        def close(self) -> None:
            return None

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

    return Bar
