"""--dtype auto on CPU: a model never runs coarser than its file, the header is read without
parsing tensors, and the choice comes with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.gguf_header import file_type
from backends.torch import backend as torch_backend
from backends.torch import gguf_model, w4a8
from backends.torch.backend import TorchBackend, auto_cpu_dtype
from tests.ggufs import header_gguf
from tests.tiny import save_hf_folder, tiny_llama


@pytest.fixture(autouse=True)
def _no_ggml(monkeypatch):
    """The choices below ggml's: what auto picks on a machine without llama-cpp-python."""
    monkeypatch.setattr(gguf_model, "unavailable_reason", lambda: "no kernel (test)")


def _gguf(path: Path, ftype: int) -> Path:
    def fields(writer) -> None:
        writer.add_token_list(["<s>", "a", "bc"])  # an array of strings before the file type
        writer.add_token_scores([0.0, -1.0, -2.0])
        writer.add_file_type(ftype)

    return header_gguf(path, fields=fields)


@pytest.mark.parametrize("ftype, name, bits", [(15, "Q4_K_M", 4.9), (7, "Q8_0", 8.5),
                                               (1, "F16", 16.0)])
def test_the_file_type_is_read_from_the_gguf_header(tmp_path, ftype, name, bits):
    assert file_type(_gguf(tmp_path / "m.gguf", ftype)) == (name, bits)


def test_a_file_that_is_not_a_gguf_has_no_file_type(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(40))
    (tmp_path / "y.gguf").write_bytes(b"GGUF\x03\x00")  # cut short
    assert file_type(tmp_path / "x.gguf") is None and file_type(tmp_path / "y.gguf") is None


@pytest.mark.parametrize("ftype", [15, 7, 1])
def test_auto_computes_any_gguf_on_its_own_blocks_where_ggml_is_installed(tmp_path, monkeypatch,
                                                                          ftype):
    monkeypatch.setattr(gguf_model, "unavailable_reason", lambda: None)
    dtype, why = auto_cpu_dtype(_gguf(tmp_path / "m.gguf", ftype))
    assert dtype == "gguf" and "own" in why and "nothing converted" in why


def test_auto_runs_a_4_bit_source_in_w4a8_where_its_kernel_runs_and_says_why(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr(w4a8, "is_exact", lambda: True)
    dtype, why = auto_cpu_dtype(_gguf(tmp_path / "m.gguf", 15))
    assert dtype == "w4a8" and "Q4_K_M" in why and "8-bit activations" in why


def test_auto_runs_a_4_bit_source_in_int4_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(w4a8, "is_exact", lambda: False)
    monkeypatch.setattr(torch_backend, "AUTO_INT4", True)
    monkeypatch.setattr(torch_backend, "int4_is_exact", lambda: True)
    dtype, why = auto_cpu_dtype(_gguf(tmp_path / "m.gguf", 15))
    assert dtype == "int4" and "Q4_K_M" in why


def test_auto_runs_an_8_bit_source_in_w8a8_never_in_4_bits(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_backend, "w8a8_is_exact", lambda: True)
    monkeypatch.setattr(w4a8, "is_exact", lambda: True)
    assert auto_cpu_dtype(_gguf(tmp_path / "m.gguf", 7))[0] == "w8a8"


def test_auto_runs_a_4_bit_source_in_4_bits_where_a_row_check_passes_on_this_cpu(
        tmp_path, monkeypatch):
    monkeypatch.setattr(torch_backend, "w8a8_is_exact", lambda: True)
    exact = torch_backend.int4_is_available() and torch_backend.int4_is_exact()
    expected = "w4a8" if w4a8.is_exact() else "int4" if exact else "w8a8"
    assert auto_cpu_dtype(_gguf(tmp_path / "m.gguf", 15))[0] == expected


def test_auto_falls_back_to_8_bits_where_int4_is_not_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(w4a8, "is_exact", lambda: False)
    monkeypatch.setattr(torch_backend, "AUTO_INT4", True)
    monkeypatch.setattr(torch_backend, "int4_is_exact", lambda: False)
    monkeypatch.setattr(torch_backend, "w8a8_is_exact", lambda: True)
    assert auto_cpu_dtype(_gguf(tmp_path / "m.gguf", 15))[0] == "w8a8"


def test_auto_keeps_a_16_bit_source_unquantized(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_backend, "cpu_has_native_bf16", lambda: True)
    assert auto_cpu_dtype(_gguf(tmp_path / "m.gguf", 1))[0] == "bfloat16"
    folder = save_hf_folder(tiny_llama(seed=1), tmp_path / "tiny")
    model = TorchBackend().load(str(folder), device="cpu", dtype="auto")
    assert model.dtype == "bfloat16" and "16-bit" in model.dtype_reason
