"""The safetensors folder next to a .gguf: built once, rebuilt when its source changed, shared
safely between processes converting the same file. A fake converter stands in for
transformers (it copies the GGUF's bytes), so these run in milliseconds."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from app.core.types import SpecdeckError
from backends.gguf import converted_path, hf_folder, read_record
from tests.ggufs import header_gguf

GGUF = b"GGUF" + bytes(range(256)) * 64


class FakeConverter:
    """Writes config.json and a copy of the source, so a test can see what it was built from."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls = 0
        self.delay_s = delay_s
        self.started = threading.Event()

    def __call__(self, gguf: Path, dest: Path) -> None:
        self.calls += 1
        self.started.set()
        time.sleep(self.delay_s)
        (dest / "config.json").write_text("{}")
        (dest / "weights.bin").write_bytes(gguf.read_bytes())


def later(path: Path, seconds: int = 1) -> None:
    """Move the mtime forward, as time passing between two edits would."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def edit(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)
    later(path)


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(GGUF)
    return path


def built_from(gguf: Path) -> bytes:
    return (converted_path(gguf) / "weights.bin").read_bytes()


def test_a_conversion_is_built_once_and_reused(gguf):
    convert = FakeConverter()
    assert hf_folder(gguf, convert) == converted_path(gguf)
    assert hf_folder(gguf, convert) == converted_path(gguf)
    assert convert.calls == 1 and built_from(gguf) == GGUF
    assert read_record(converted_path(gguf)).size == len(GGUF)


def test_a_killed_conversions_leftovers_are_swept_by_the_next_one(gguf):
    dest = converted_path(gguf)
    left = gguf.parent / f".converting-{dest.name}-x1"
    stale = gguf.parent / f".stale-{dest.name}-x2"
    others = gguf.parent / ".converting-another.gguf.hf-x3"  # another source's, maybe live
    for folder in (left, stale, others):
        folder.mkdir()
        (folder / "weights.bin").write_bytes(b"half")
    hf_folder(gguf, FakeConverter())
    assert not left.exists() and not stale.exists() and others.exists()
    assert sorted(p.name for p in gguf.parent.iterdir() if p.name.startswith(".")) == [
        others.name]


@pytest.mark.parametrize("change", ["flip a byte", "overwrite the magic", "replace the file"])
def test_a_changed_source_rebuilds_its_conversion(gguf, change):
    convert = FakeConverter()
    hf_folder(gguf, convert)
    if change == "flip a byte":
        edit(gguf, 100, bytes([GGUF[100] ^ 1]))
    elif change == "overwrite the magic":
        edit(gguf, 0, b"XXXX")
    else:
        gguf.write_bytes(GGUF + b"more")
    hf_folder(gguf, convert)
    assert convert.calls == 2 and built_from(gguf) == gguf.read_bytes()


def test_restoring_a_flipped_byte_rebuilds_again(gguf):
    convert = FakeConverter()
    edit(gguf, 100, bytes([GGUF[100] ^ 1]))
    hf_folder(gguf, convert)  # converted from the corrupted file
    edit(gguf, 100, GGUF[100:101])
    hf_folder(gguf, convert)
    assert convert.calls == 2 and built_from(gguf) == GGUF


def test_a_touched_source_with_the_same_bytes_keeps_its_conversion(gguf):
    convert = FakeConverter()
    hf_folder(gguf, convert)
    later(gguf)
    hf_folder(gguf, convert)
    assert convert.calls == 1
    assert read_record(converted_path(gguf)).mtime_ns == gguf.stat().st_mtime_ns  # no rehash next


def test_a_conversion_without_a_source_record_is_rebuilt(gguf):
    old = converted_path(gguf)
    old.mkdir()
    (old / "config.json").write_text("{}")  # an older specdeck's conversion: source unknown
    convert = FakeConverter()
    hf_folder(gguf, convert)
    assert convert.calls == 1 and built_from(gguf) == GGUF


def test_a_second_process_converting_the_same_file_reuses_the_first_ones_work(gguf):
    first, second = FakeConverter(delay_s=0.5), FakeConverter()
    results: dict[str, object] = {}

    def load(name: str, convert: FakeConverter) -> None:
        try:
            results[name] = hf_folder(gguf, convert)
        except Exception as error:  # noqa: BLE001 - the test reports it
            results[name] = error

    a = threading.Thread(target=load, args=("a", first))
    a.start()
    assert first.started.wait(10)
    b = threading.Thread(target=load, args=("b", second))
    b.start()
    a.join(10)
    b.join(10)
    assert results == {"a": converted_path(gguf), "b": converted_path(gguf)}
    assert first.calls == 1 and second.calls == 0
    assert gguf.with_name(gguf.name + ".specdeck-lock").exists()  # never deleted


def test_a_failed_conversion_leaves_nothing_that_looks_complete(gguf):
    def broken(_gguf: Path, dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        raise SpecdeckError("could not read model.gguf")

    with pytest.raises(SpecdeckError, match="could not read"):
        hf_folder(gguf, broken)
    assert not converted_path(gguf).exists()
    assert [p.name for p in gguf.parent.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("code, advice", [(errno.ENOSPC, "disk is full.*free some disk space"),
                                          (errno.EACCES, "writable")])
def test_a_write_error_names_its_own_fix(gguf, code, advice):
    def failing(_gguf: Path, _dest: Path) -> None:
        raise OSError(code, os.strerror(code))

    with pytest.raises(SpecdeckError, match=advice) as caught:
        hf_folder(gguf, failing)
    if code != errno.ENOSPC:
        assert "disk space" not in str(caught.value)
    assert not converted_path(gguf).exists()


@pytest.mark.parametrize("name, fix", [("missing.gguf", "specdeck pull"),
                                       ("notes.txt", "neither a folder nor a .gguf")])
def test_a_bad_path_is_refused_naming_the_fix(tmp_path, name, fix):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(SpecdeckError, match=fix):
        hf_folder(tmp_path / name, FakeConverter())


def test_a_gguf_of_a_family_transformers_cannot_read_names_the_safetensors_route(tmp_path):
    """Qwen3-Next's qwen3next: read as a damaged file, it would send the user to download a
    good one again. transformers cannot dequantize it; the refusal names the blocks path
    (whose config specdeck reads itself: tests/test_gguf_moe.py) and the other routes."""
    pytest.importorskip("torch")

    path = header_gguf(tmp_path / "next.gguf", "qwen3next")
    with pytest.raises(SpecdeckError, match=r"is a qwen3next GGUF.*--dtype gguf.*safetensors "
                                            r"checkpoint.*--backend llamacpp") as refused:
        hf_folder(path)
    assert "corrupt" not in str(refused.value)
    assert not converted_path(path).exists()  # nothing half-written looks complete


def test_the_header_names_a_ggufs_architecture_without_reading_its_tensors(tmp_path):
    from backends.gguf_header import architecture

    assert architecture(header_gguf(tmp_path / "g.gguf", "gemma4")) == "gemma4"
    assert architecture(tmp_path / "g.gguf.missing") is None
