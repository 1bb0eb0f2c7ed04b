"""--dtype auto is one rule (backends/dtype_rule.py): the planner, asking with predictions, and
the torch loader, asking with measurements, pick the same dtype for the same answers; the
rule asks a probe only when it reaches it; the planner decides without importing torch or a
module of backends.torch."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.catalogue import hardware
from backends.dtype_rule import Probes, Source, auto_dtype
from backends.gguf_header import file_type
from tests.ggufs import header_gguf

ROOT = Path(__file__).resolve().parent.parent
PROBES = ("gguf", "w4a8", "int4", "w8a8", "native_bf16")
# ftype -> the catalogue's name for it: Q4_K_M (4.9 bits), Q4_0 (4.5), Q6_K (6.6), Q8_0 (8.5),
# F16, and a type the header table does not know (0 bits: unknown)
FTYPES = {15: "gguf-q4_k_m", 2: "gguf-q4_0", 18: "gguf-q6_k", 7: "gguf-q8_0", 1: "gguf-f16",
          99: None}


def _gguf(path: Path, ftype: int) -> Path:
    return header_gguf(path, fields=lambda writer: writer.add_file_type(ftype))


def _answers() -> list[dict[str, bool]]:
    return [dict(zip(PROBES, bits, strict=True))
            for bits in itertools.product((False, True), repeat=len(PROBES))]


def _predict(monkeypatch, answer: dict[str, bool]) -> None:
    monkeypatch.setattr(hardware, "_gguf_runs_here", lambda: answer["gguf"])
    monkeypatch.setattr("backends.cpu.cpu_has_w4a8", lambda: answer["w4a8"])
    monkeypatch.setattr(hardware, "_torch_has_int4", lambda: answer["int4"])
    monkeypatch.setattr("backends.cpu.cpu_has_vnni", lambda: answer["w8a8"])
    monkeypatch.setattr("backends.cpu.cpu_has_native_bf16", lambda: answer["native_bf16"])


def _measure(monkeypatch, answer: dict[str, bool]) -> None:
    torch_backend = pytest.importorskip("backends.torch.backend")
    from backends.torch import gguf_model, w4a8

    monkeypatch.setattr(gguf_model, "unavailable_reason",
                        lambda: None if answer["gguf"] else "no kernel (test)")
    monkeypatch.setattr(w4a8, "is_exact", lambda: answer["w4a8"])
    monkeypatch.setattr(torch_backend, "AUTO_INT4", True)
    monkeypatch.setattr(torch_backend, "int4_is_available", lambda: answer["int4"])
    monkeypatch.setattr(torch_backend, "int4_is_exact", lambda: True)
    monkeypatch.setattr(torch_backend, "w8a8_is_exact", lambda: answer["w8a8"])
    monkeypatch.setattr(torch_backend, "cpu_has_native_bf16", lambda: answer["native_bf16"])


@pytest.mark.parametrize("ftype", FTYPES)
def test_the_planner_and_the_torch_loader_pick_the_same_dtype_for_a_gguf(tmp_path, monkeypatch,
                                                                         ftype):
    from backends.torch.backend import auto_cpu_dtype

    path = _gguf(tmp_path / "m.gguf", ftype)
    _name, bits = file_type(path)
    for answer in _answers():
        _predict(monkeypatch, answer)
        _measure(monkeypatch, answer)
        loaded = auto_cpu_dtype(path)[0]
        local = hardware.dtype_for("torch", "cpu", bits=bits, gguf=True)
        assert local == loaded, (ftype, answer)
        if FTYPES[ftype]:  # the same file named by the catalogue's format
            assert hardware.dtype_for("torch", "cpu", FTYPES[ftype]) == loaded, (ftype, answer)


def test_the_planner_and_the_torch_loader_keep_a_16_bit_folder_unquantized_alike(monkeypatch):
    from backends.torch.backend import auto_cpu_dtype, resolve_dtype

    for answer in _answers():
        _predict(monkeypatch, answer)
        _measure(monkeypatch, answer)
        loaded = auto_cpu_dtype(Path("a-folder"))[0]
        assert hardware.dtype_for("torch", "cpu", "safetensors-bf16") == loaded, answer
        assert str(resolve_dtype("auto", "cpu")).removeprefix("torch.") == loaded, answer
        assert loaded == ("bfloat16" if answer["native_bf16"] else "float32")


def _only(*asked: str, log: list[str]) -> Probes:
    def probe(name: str):
        def answer() -> bool:
            log.append(name)
            return name in asked
        return answer
    return Probes(**{name: probe(name) for name in PROBES})


def test_a_probe_is_asked_only_when_the_rule_reaches_it():
    log: list[str] = []
    assert auto_dtype(Source(), _only("native_bf16", log=log))[0] == "bfloat16"
    assert log == ["native_bf16"]  # a 16-bit folder builds no kernel
    log.clear()
    assert auto_dtype(Source(True, "Q8_0", 8.5), _only("w8a8", log=log))[0] == "w8a8"
    assert log == ["gguf", "w8a8"]  # an 8-bit source never asks the 4-bit kernels
    log.clear()
    assert auto_dtype(Source(True, "Q4_K_M", 4.9), _only("gguf", log=log))[0] == "gguf"
    assert log == ["gguf"]


def test_a_source_never_runs_coarser_than_its_file_even_where_every_kernel_runs():
    every = Probes(**{name: (lambda: True) for name in PROBES})
    assert auto_dtype(Source(False, "Q8_0", 8.5), every)[0] == "w8a8"
    assert auto_dtype(Source(False, "Q6_K", 6.6), every)[0] == "w8a8"
    assert auto_dtype(Source(False, "Q4_K_M", 4.9), every)[0] == "w4a8"
    assert auto_dtype(Source(False, "F16", 16.0), every)[0] == "bfloat16"
    assert auto_dtype(Source(False, "type 99", 0.0), every)[0] == "bfloat16"  # unknown bits


def test_cuda_runs_bfloat16_whatever_the_source():
    none = Probes(**{name: (lambda: False) for name in PROBES})
    assert auto_dtype(Source(True, "Q4_K_M", 4.9), none, "cuda:0")[0] == "bfloat16"


def test_the_planner_decides_a_dtype_without_importing_torch_or_its_backend():
    # backends.torch itself (its RUNS) is torch-free; none of its modules may load
    code = ("import sys; from app.catalogue import hardware, planner; "
            "hardware.dtype_for('torch', 'cpu', 'gguf-q4_k_m'); "
            "hardware.dtype_for('torch', 'cpu', 'safetensors-bf16'); "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('backends.torch.')]; "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
