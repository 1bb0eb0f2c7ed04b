"""A GGUF file as an HF-format folder: the safetensors copy next to it, built once, kept fresh.

Knows: the converted folder's name (`<file>.gguf.specdeck-hf/`), the record of the source it
was built from (size, mtime, sha256), the lock that lets one process convert while others
wait and then reuse its work, and why transformers could not read a file (an architecture
it reads no GGUF of, or a damaged file). Must not know: the store's layout, the catalogue,
which backend loads the folder (torch and MLX both call `hf_folder`). torch and transformers
are imported inside the conversion only, so MLX-only installs can import this module.

A conversion is used while its source still has the recorded size and mtime (a stat, every
load); when either changed the source is rehashed, and a different sha256 rebuilds the
folder (a restored byte, a replaced file, an overwritten magic). The folder appears by rename
only when complete, with its record inside, so a half-written conversion never looks finished.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from app.core.types import SpecdeckError
from backends.digest import sha256_of
from backends.extras import install_hint
from backends.gguf_header import architecture

CONVERTED_SUFFIX = ".specdeck-hf"  # folder next to a .gguf holding its safetensors copy
METADATA_SUFFIX = ".specdeck-meta"  # folder next to a .gguf holding its config and tokenizer
SOURCE_RECORD = ".specdeck-source.json"  # inside the folder: the GGUF it was built from
LOCK_SUFFIX = ".specdeck-lock"  # next to the .gguf; never deleted (others may wait on it)
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)

Converter = Callable[[Path, Path], None]  # (gguf, empty folder to fill)
# architectures whose config specdeck builds itself from a file's metadata (transformers 5.25
# reads none from a qwen3next GGUF); torch's blocks path then computes on the file
OWN_CONFIG_READERS = frozenset({"qwen3next"})


@dataclass(frozen=True)
class SourceRecord:
    """What the GGUF was when its folder was built."""

    size: int
    mtime_ns: int
    sha256: str

    def same_stat(self, path: Path) -> bool:
        st = path.stat()
        return st.st_size == self.size and st.st_mtime_ns == self.mtime_ns


def converted_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + CONVERTED_SUFFIX)


def hf_folder(path: Path, convert: Converter | None = None) -> Path:
    """An HF-format folder for path: itself, or the fresh conversion of a .gguf file.
    convert fills a folder from a GGUF (default: transformers' dequantization)."""
    if not path.exists():
        raise SpecdeckError(f"model not found: {path}. Give an HF model folder or a .gguf file, "
                            "or download a pair with `specdeck pull`")
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise SpecdeckError(f"{path} is neither a folder nor a .gguf file")
    return _fresh(path, converted_path(path), convert or convert_with_transformers,
                  "converting {} to safetensors")


def metadata_folder(gguf: Path) -> Path:
    """A folder beside gguf with its config.json and tokenizer files, read from its header
    once (megabytes: the weights stay in the .gguf, which the torch backend computes on)."""
    return _fresh(gguf, gguf.with_name(gguf.name + METADATA_SUFFIX), save_metadata,
                  "reading the config and tokenizer of {}")


def _fresh(gguf: Path, dest: Path, convert: Converter, doing: str) -> Path:
    record = read_record(dest)
    if record is not None and record.same_stat(gguf):
        return dest  # the common case: one stat, no lock, no hash
    with _locked(gguf):
        _refresh(gguf, dest, convert, doing)
    return dest


def read_record(dest: Path) -> SourceRecord | None:
    """The source record of a finished conversion; None when there is none (or no folder)."""
    try:
        data = json.loads((dest / SOURCE_RECORD).read_text(encoding="utf-8"))
        return SourceRecord(int(data["size"]), int(data["mtime_ns"]), str(data["sha256"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_source(gguf: Path, dest: Path) -> SourceRecord:
    """Write the record that ties dest to gguf as it is now (a conversion's last step)."""
    st = gguf.stat()
    record = SourceRecord(st.st_size, st.st_mtime_ns, sha256_of(gguf))
    _write_record(dest, record)
    return record


def _refresh(gguf: Path, dest: Path, convert: Converter, doing: str) -> None:
    """Under the lock: reuse what another process finished, or what only got a new mtime;
    otherwise build the folder again."""
    record = read_record(dest)
    if record is not None and record.same_stat(gguf):
        return  # another process converted it while this one waited
    if record is not None and record.size == gguf.stat().st_size:
        digest = sha256_of(gguf)
        if digest == record.sha256:  # touched or copied back, same bytes: keep the folder
            st = gguf.stat()
            _write_record(dest, SourceRecord(st.st_size, st.st_mtime_ns, digest))
            return
    _build(gguf, dest, convert, doing, stale=dest.exists())


def _build(gguf: Path, dest: Path, convert: Converter, doing: str, stale: bool) -> None:
    why = "its .gguf changed since it was read" if stale else "once; later loads take seconds"
    print(f"specdeck: {doing.format(gguf.name)} ({why})...", file=sys.stderr)
    _sweep(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".converting-{dest.name}-", dir=dest.parent))
    try:
        before = gguf.stat()
        convert(gguf, tmp)
        if gguf.stat().st_mtime_ns != before.st_mtime_ns:
            raise SpecdeckError(f"{gguf} changed while it was being converted: run again once "
                                "nothing writes to it")
        record_source(gguf, tmp)
        _swap_in(tmp, dest)
    except OSError as error:
        raise _write_error(dest, error) from error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sweep(dest: Path) -> None:
    """Delete what a killed conversion of this folder left (its temporary and stale folders);
    under the source's lock, so no live conversion of it owns them, and another source's
    folders, named after their own dest, are never touched."""
    for prefix in (".converting-", ".stale-"):
        for left in dest.parent.glob(f"{prefix}{dest.name}-*"):
            shutil.rmtree(left, ignore_errors=True)


def _swap_in(tmp: Path, dest: Path) -> None:
    """Replace dest by tmp; an older folder moves aside first (rename cannot replace a
    non-empty folder) and is deleted after."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".stale-{dest.name}-", dir=dest.parent))
        os.replace(dest, old / "folder")
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_record(dest: Path, record: SourceRecord) -> None:
    fd, tmp = tempfile.mkstemp(prefix=SOURCE_RECORD, dir=dest)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(asdict(record), f)
    os.replace(tmp, dest / SOURCE_RECORD)


def _write_error(dest: Path, error: OSError) -> SpecdeckError:
    if error.errno in _FULL_DISK:
        return SpecdeckError(f"the disk is full while writing the converted model to {dest}: "
                             "free some disk space (the conversion needs about 4x the .gguf's "
                             "size) and run again")
    return SpecdeckError(f"could not write the converted model to {dest}: {error}. Check that "
                         "the folder is writable, or copy the .gguf to a folder that is")


@contextmanager
def _locked(gguf: Path) -> Iterator[None]:
    """One converter per file across processes; the others wait, then reuse its folder."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(gguf.with_name(gguf.name + LOCK_SUFFIX)))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(f"specdeck: another process is converting {gguf.name}; waiting for it",
                  file=sys.stderr)
            lock.acquire()
    except OSError as error:  # a read-only folder: the lock (and the folder) cannot be made
        raise _write_error(gguf.parent, error) from error
    try:
        yield
    finally:
        lock.release()


def convert_with_transformers(gguf: Path, dest: Path) -> None:
    """Dequantize a GGUF into an fp32 safetensors folder (dest exists and is empty)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:
        raise SpecdeckError(f"{gguf.name} must be converted to safetensors once, which needs "
                            f"the torch backend: {install_hint('torch')}, then run again "
                            "(later loads use the converted folder)") from error
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as error:
        raise read_error(gguf, error) from error
    # transformers refuses to save GGUF-quantized models; the weights are already dequantized
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def read_error(gguf: Path, error: Exception) -> SpecdeckError:
    """What went wrong reading a GGUF through transformers: an architecture it reads no GGUF
    of (Qwen3-Next's qwen3next, which torch's blocks path reads itself; Qwen3.5's qwen35 where
    transformers predates its reader, which 5.25 has), with the routes that do load the model,
    else a partial or damaged file."""
    if "is not supported yet" in str(error):
        arch = architecture(gguf) or "its"
        if arch in OWN_CONFIG_READERS:
            return SpecdeckError(
                f"{gguf.name} is a {arch} GGUF, and transformers reads no {arch} GGUF yet, so "
                f"it cannot be dequantized: on torch, --dtype gguf computes on the file's own "
                f"blocks (on a CPU with specdeck's or ggml's kernels); otherwise give the "
                f"model's safetensors checkpoint (its HF folder, as --target FOLDER; the MLX "
                f"build's folder on MLX), or run the file with --backend llamacpp")
        return SpecdeckError(
            f"{gguf.name} is a {arch} GGUF, and transformers reads no {arch} GGUF yet, so "
            f"specdeck cannot load this file on torch or MLX: give the model's safetensors "
            f"checkpoint instead (its HF folder, as --target FOLDER; the MLX build's folder on "
            f"MLX), or run the file with --backend llamacpp")
    return SpecdeckError(f"could not read {gguf}: {error}. The file may be partial or "
                         "corrupt: `specdeck pull --verify PAIR` repairs a pulled model; "
                         "otherwise download it again")


def save_metadata(gguf: Path, dest: Path) -> None:
    """config.json and the tokenizer's files of a GGUF, from its header (dest is empty)."""
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError as error:
        raise SpecdeckError(f"reading {gguf.name} needs the torch backend: "
                            f"{install_hint('torch')}") from error
    try:
        if architecture(gguf) in OWN_CONFIG_READERS:
            config, tokenizer = _read_own(gguf)
        else:
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as error:
        raise read_error(gguf, error) from error
    config.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _read_own(gguf: Path) -> tuple[object, object]:
    """Config and tokenizer of a GGUF whose metadata transformers has no reader of: the
    config built by specdeck (torch's layout module), the tokenizer by transformers' own
    GGUF vocabulary reader, which any architecture's file feeds."""
    from transformers import AutoConfig, PreTrainedTokenizerFast
    from transformers.integrations.gguf import read_gguf_metadata

    from backends.torch import qwen35_layout

    metadata, tensor_names = read_gguf_metadata(str(gguf))
    config = AutoConfig.for_model(**qwen35_layout.qwen3next_config(metadata, tensor_names))
    return config, PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
