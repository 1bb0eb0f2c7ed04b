"""The planner picks MTP, then a published head, then a same-family draft, then n-gram, and
says why; its memory figures match hand-computed values for real configs."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from app import store
from app.catalogue import hardware, planner, preference, sizing, target_info
from app.catalogue.registry import load_catalogue
from app.catalogue.sizing import Sizing
from app.core.protocols import Runs
from app.core.types import SpecdeckError
from app.store.cli import models_table
from backends.torch import RUNS as TORCH_RUNS

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
GB = 10**9


def building(*kinds: str) -> Runs:
    """torch's declaration, as a backend that builds only these kinds (those that need
    nothing run everywhere)."""
    return replace(TORCH_RUNS, backend="partial", builds=frozenset(kinds))


def refused_as_unbuilt(plan) -> set[str]:
    return {o.kind for o in plan.refused
            if o.reason.startswith(f"drafter {o.kind!r} runs on the torch backend only")}




@pytest.fixture(scope="module")
def catalogue():
    return load_catalogue()


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def model_folder(tmp_path: Path, name: str, params: int = 0, tensor: str = "w") -> Path:
    """An HF folder: a real config.json, and a safetensors file of `params` elements, under
    the tensor name given."""
    from safetensors.numpy import save_file

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config(name)))
    if params:
        save_file({tensor: np.zeros(params, dtype=np.float16)}, str(folder / "model.safetensors"))
    return folder


MIMO_MTP = "model.mtp_layers.0.token_layernorm.weight"  # a name of MiMo's own MTP layer


@pytest.fixture(autouse=True)
def no_gguf_kernel(monkeypatch):
    """The rules for sources torch converts; the tests of a GGUF on its blocks switch it on."""
    monkeypatch.setattr(hardware, "_gguf_runs_here", lambda: False)


# ---- arithmetic ------------------------------------------------------------------------


def test_kv_bytes_per_token_of_two_real_configs_match_the_hand_computed_values(catalogue):
    qwen = target_info.arch_from_config(config("qwen2.5-coder-1.5b-instruct"))
    llama = target_info.arch_from_config(config("llama-3.1-8b-instruct"))
    assert sizing.kv_bytes_per_token(qwen, 2) == 28 * 2 * 128 * 2 * 2 == 28_672
    assert sizing.kv_bytes_per_token(qwen, 4) == 57_344  # fp32, as torch runs on a CPU
    assert sizing.kv_bytes_per_token(llama, 2) == 32 * 8 * 128 * 2 * 2 == 131_072
    # the catalogue carries the same numbers as the checkpoints' configs
    assert catalogue.model("qwen2.5-coder-1.5b-instruct-q4km").arch == qwen
    assert catalogue.model("llama3.1-8b-instruct").arch == llama


def test_fit_of_llama_8b_with_its_1b_draft_on_24gb_of_cuda_matches_the_hand_computation(
        catalogue):
    pair = catalogue.pair("llama3.1-8b+3.2-1b")
    fit = sizing.pair_fit(pair, "torch", "cuda", 24 * GB, 4096)
    # 10% kept back, and the runtime's 400 MiB
    assert (fit.dtype, fit.usable_bytes) == ("bfloat16", 21_600_000_000 - 400 * 2**20)
    assert fit.target_weights_bytes == 8_030_261_248 * 2
    assert fit.drafter_weights_bytes == 1_235_814_400 * 2
    assert fit.drafter_kv_per_token == 16 * 8 * 64 * 2 * 2 == 32_768
    # (21_180_569_600 - 16_060_522_496) // 131_072 = 39_062 tokens without the drafter
    assert fit.max_context_plain == 39_062
    # (21_180_569_600 - 16_060_522_496 - 2_471_628_800) // (131_072 + 32_768) = 16_164 with it
    assert fit.max_context_spec == 16_164
    assert (fit.streams_plain, fit.streams_spec) == (9, 3)  # streams of 4096 tokens


def test_fit_of_the_default_pair_on_16gb_of_cpu_ram_is_capped_by_the_trained_context(
        catalogue, monkeypatch):
    monkeypatch.setattr("backends.cpu.cpu_has_native_bf16", lambda: False)  # a CPU without bf16
    monkeypatch.setattr("backends.cpu.cpu_has_vnni", lambda: False)  # nor VNNI: float32
    monkeypatch.setattr(hardware, "_torch_has_int4", lambda: False)  # nor torch's int4 kernel
    monkeypatch.setattr("backends.cpu.cpu_has_w4a8", lambda: False)
    fit = sizing.pair_fit(catalogue.pair("qwen2.5-coder-1.5b+0.5b"), "torch", "cpu",
                           16 * GB, 4096)
    assert (fit.dtype, fit.target_kv_per_token, fit.drafter_kv_per_token) == \
        ("float32", 57_344, 24 * 2 * 64 * 2 * 4)
    assert (fit.max_context_plain, fit.max_context_spec) == (32_768, 32_768)
    # (14.4e9 - 400 MiB - 6_174_857_216) // (57_344 * 4096) = 33; minus the draft:
    # 5_829_581_312 // ((57_344 + 24_576) * 4096) = 17
    assert (fit.streams_plain, fit.streams_spec) == (33, 17)
    assert fit.summary() == "32768/32768, 33/17"


def test_memory_is_planned_for_the_dtype_generate_runs_on_this_machine(catalogue):
    torch_backend = pytest.importorskip("backends.torch.backend")
    from backends.torch import w4a8
    from backends.torch.quantized_linear import int4_is_available, int4_is_exact, w8a8_is_exact

    unquantized = str(torch_backend.resolve_dtype("auto", "cpu")).removeprefix("torch.")
    # a Q4_K GGUF runs w4a8 where its kernel builds and passes its row check, else int4 where
    # torch has the kernel and its row check passes, else w8a8
    # where the int8 check passes (auto_cpu_dtype), else unquantized
    runs = ("w4a8" if w4a8.is_exact() else
            "int4" if int4_is_available() and int4_is_exact() else
            "w8a8" if w8a8_is_exact() else unquantized)
    fit = sizing.pair_fit(catalogue.pair("qwen2.5-coder-1.5b+0.5b"), "torch", "cpu", 16 * GB,
                           4096)
    assert fit.dtype == runs
    assert hardware.dtype_for("torch", "cpu", "safetensors-bf16") == unquantized
    assert fit.target_kv_per_token == 57_344 // (1 if runs == "float32" else 2)


def test_a_cpu_with_native_bf16_plans_half_the_float32_memory(catalogue, monkeypatch):
    pair = catalogue.pair("qwen2.5-coder-1.5b+0.5b")
    monkeypatch.setattr("backends.cpu.cpu_has_vnni", lambda: False)
    monkeypatch.setattr(hardware, "_torch_has_int4", lambda: False)
    monkeypatch.setattr("backends.cpu.cpu_has_w4a8", lambda: False)
    monkeypatch.setattr("backends.cpu.cpu_has_native_bf16", lambda: False)
    fp32 = sizing.pair_fit(pair, "torch", "cpu", 16 * GB, 4096)
    monkeypatch.setattr("backends.cpu.cpu_has_native_bf16", lambda: True)
    bf16 = sizing.pair_fit(pair, "torch", "cpu", 16 * GB, 4096)
    assert (fp32.dtype, bf16.dtype) == ("float32", "bfloat16")
    assert bf16.target_weights_bytes * 2 == fp32.target_weights_bytes


def test_a_quantized_gguf_on_a_vnni_cpu_plans_int8_weights_and_a_bf16_cache(catalogue,
                                                                           monkeypatch):
    monkeypatch.setattr("backends.cpu.cpu_has_vnni", lambda: True)
    monkeypatch.setattr(hardware, "_torch_has_int4", lambda: False)
    monkeypatch.setattr("backends.cpu.cpu_has_w4a8", lambda: False)
    fit = sizing.pair_fit(catalogue.pair("qwen2.5-coder-1.5b+0.5b"), "torch", "cpu", 16 * GB,
                           4096)
    assert fit.dtype == "w8a8"
    assert fit.target_weights_bytes == catalogue.model("qwen2.5-coder-1.5b-instruct-q4km").params
    assert fit.target_kv_per_token == 57_344 // 2


def test_a_4_bit_gguf_where_torch_has_int4_plans_its_codes_and_their_scales(catalogue,
                                                                                monkeypatch):
    monkeypatch.setattr(hardware, "_torch_has_int4", lambda: True)
    monkeypatch.setattr("backends.cpu.cpu_has_w4a8", lambda: False)
    fit = sizing.pair_fit(catalogue.pair("qwen2.5-coder-1.5b+0.5b"), "torch", "cpu", 16 * GB,
                           4096)
    params = catalogue.model("qwen2.5-coder-1.5b-instruct-q4km").params
    assert fit.dtype == "int4"
    assert fit.target_weights_bytes == int(params * 0.625)
    assert fit.target_kv_per_token == 57_344 // 2
    assert hardware.dtype_for("torch", "cpu", "gguf-q8_0") != "int4"


def test_an_ngram_drafter_costs_no_context():
    target = Sizing(weights_bytes=GB, kv_bytes_per_token=1000, context_limit=10**7)
    fit = sizing.fit(target, None, 3 * GB, 1000)
    assert fit.max_context_plain == fit.max_context_spec == (2_700_000_000 - GB) // 1000


def test_parse_bytes_reads_the_usual_units():
    assert sizing.parse_bytes("16GB") == 16 * GB
    assert sizing.parse_bytes("12 GiB") == 12 * 2**30
    assert sizing.parse_bytes("800mb") == 800 * 10**6
    with pytest.raises(SpecdeckError, match="16GB"):
        sizing.parse_bytes("lots")


# ---- choices ---------------------------------------------------------------------------


def test_a_target_with_mtp_layers_drafts_with_them(tmp_path):
    folder = model_folder(tmp_path, "mimo-7b-rl", params=1000, tensor=MIMO_MTP)
    plan = planner.plan(str(folder), "torch", "cuda", 80 * GB)
    assert plan.choice.kind == "mtp" and "1 native MTP layer" in plan.choice.reason
    assert plan.fit.drafter_weights_bytes == 0  # the MTP layer lives in the target's weights
    assert plan.fit.drafter_kv_per_token == 1 * 8 * 128 * 2 * 2


def test_mtp_layers_its_files_dropped_are_not_planned_and_the_reason_names_the_fix(tmp_path):
    plan = planner.plan(str(model_folder(tmp_path, "mimo-7b-rl", params=1000)), "torch",
                        "cuda", 80 * GB)
    assert plan.choice.kind != "mtp"
    assert any(o.kind == "mtp" and "its files hold none" in o.reason for o in plan.absent)


def test_mtp_layers_are_refused_with_the_reason_where_the_backend_does_not_build_mtp(
        tmp_path):
    plan = planner.plan(str(model_folder(tmp_path, "mimo-7b-rl", params=1000, tensor=MIMO_MTP)),
                        "torch", "cuda", 80 * GB, runs=building(*TORCH_RUNS.builds - {"mtp"}))
    assert plan.choice.kind == "lookahead"  # on CUDA the model-free tree comes before lookup
    assert [o.kind for o in plan.refused] == ["mtp"] and refused_as_unbuilt(plan) == {"mtp"}


def test_a_listed_head_is_preferred_to_the_draft_model_when_it_fits(catalogue):
    plan = planner.plan("qwen3-4b", "torch", "cuda", 40 * GB, catalogue=catalogue,
                        runs=building(*TORCH_RUNS.builds - {"dspark"}))
    assert (plan.choice.kind, plan.choice.model.id) == ("dflash", "dflash-qwen3-4b")
    assert plan.choice.pair_id == "qwen3-4b+dflash" and plan.choice.k == 15
    assert "trained for this target" in plan.choice.reason


def test_a_head_that_does_not_fit_is_refused_and_a_lighter_one_is_chosen(catalogue):
    # target 8.04 GB + 4096 tokens of KV 0.60 GB; EAGLE-3 adds 0.46 GB, DFlash 1.16 GB; the
    # runtime 0.42 GB
    plan = planner.plan("qwen3-4b", "torch", "cuda", 11 * GB, catalogue=catalogue,
                        runs=building(*TORCH_RUNS.builds - {"dspark"}))
    assert plan.choice.kind == "eagle3"
    dflash = next(o for o in plan.refused if o.kind == "dflash")
    assert dflash.reason.startswith("does not fit") and "9.48 GB usable" in dflash.reason


def test_heads_the_backend_does_not_build_are_refused_and_the_draft_model_is_chosen(
        catalogue):
    plan = planner.plan("qwen3-4b", "torch", "cuda", 40 * GB, catalogue=catalogue,
                        runs=building("draft"))
    assert (plan.choice.kind, plan.choice.model.id) == ("draft", "qwen3-0.6b")
    assert {o.kind for o in plan.refused} == refused_as_unbuilt(plan) == \
        {"dspark", "dflash", "eagle3"}
    assert plan.reasons()[0] == ("drafter: draft qwen3-0.6b (the catalogue's draft model for "
                                 "this target)")


def test_an_eagle3_head_is_chosen_before_the_draft_model_where_dflash_is_not_built(
        catalogue):
    plan = planner.plan("qwen3-4b", "torch", "cuda", 40 * GB, catalogue=catalogue,
                        runs=building("draft", "eagle3"))
    assert (plan.choice.kind, plan.choice.model.id) == ("eagle3", "eagle3-qwen3-4b")
    assert {o.kind for o in plan.refused} == refused_as_unbuilt(plan) == {"dspark", "dflash"}
    assert plan.reasons()[0].startswith("drafter: eagle3 eagle3-qwen3-4b (trained for this "
                                        "target: ")


def test_a_head_not_downloaded_is_refused_and_the_draft_model_is_chosen(catalogue):
    installed = {"qwen3-0.6b": Path("/models/qwen3-0.6b")}
    plan = planner.plan("qwen3-4b", "torch", "cuda", 40 * GB, catalogue=catalogue,
                        installed=lambda m: installed.get(m.id))
    assert (plan.choice.kind, plan.choice.model.id) == ("draft", "qwen3-0.6b")
    eagle = next(o for o in plan.refused if o.kind == "eagle3")
    assert "not downloaded" in eagle.reason


def test_with_only_a_family_draft_downloaded_it_is_chosen_and_the_paired_one_refused(
        catalogue):
    installed = {"qwen2.5-coder-0.5b-instruct-q4km": Path("/models/coder-0.5b")}
    plan = planner.plan("qwen2.5-7b+0.5b", "torch", "cuda", 80 * GB, catalogue=catalogue,
                        installed=lambda m: installed.get(m.id))
    assert plan.choice.model.id == "qwen2.5-coder-0.5b-instruct-q4km"
    assert plan.choice.path == Path("/models/coder-0.5b")
    assert "smaller model of the qwen2.5 family" in plan.choice.reason
    assert plan.refused[0].reason == ("qwen2.5-0.5b-instruct is not downloaded (`specdeck "
                                      "pull qwen2.5-7b+0.5b` fetches it)")


def test_with_nothing_to_draft_with_the_choice_is_ngram(catalogue):
    plan = planner.plan("smollm2-135m+ngram", "torch", "cpu", 8 * GB, catalogue=catalogue)
    assert plan.choice.kind == "ngram" and plan.refused == ()
    assert plan.fit.drafter_weights_bytes == 0


def test_when_the_target_alone_does_not_fit_every_model_drafter_is_refused(catalogue):
    plan = planner.plan("qwen3-8b", "torch", "cuda", 18 * GB, catalogue=catalogue)
    assert plan.choice.kind == "lookahead"
    draft = next(o for o in plan.refused if o.kind == "draft")
    assert draft.reason.startswith("the target alone does not fit")
    assert plan.reasons()[-1].startswith("warning: target does not fit: needs 16.99 GB")


def test_a_draft_model_that_does_not_fit_beside_the_target_is_refused(catalogue):
    plan = planner.plan("llama3.1-8b-instruct", "torch", "cuda", 20 * GB, catalogue=catalogue,
                        runs=building("draft"))  # no heads
    assert plan.choice.kind == "lookahead" and plan.fit.target_fits
    refused = {o.model.id: o.reason for o in plan.refused if o.kind == "draft"}
    assert refused["llama3.2-1b-instruct"].startswith("does not fit: its weights and KV cache "
                                                      "need 2.61 GB more")


def test_a_local_folder_is_read_from_its_config_and_safetensors_header(tmp_path, catalogue,
                                                                       monkeypatch):
    monkeypatch.setattr("backends.cpu.cpu_has_native_bf16", lambda: False)  # float32 weights
    monkeypatch.setattr("backends.cpu.cpu_has_vnni", lambda: False)
    monkeypatch.setattr(hardware, "_torch_has_int4", lambda: False)
    monkeypatch.setattr("backends.cpu.cpu_has_w4a8", lambda: False)
    folder = model_folder(tmp_path, "qwen2.5-coder-1.5b-instruct", params=12_345)
    info = target_info.describe(str(folder), catalogue)
    assert info.params == 12_345 and info.arch.kv_heads == 2 and info.family == "qwen2.5"
    plan = planner.plan(str(folder), "torch", "cpu", 16 * GB, catalogue=catalogue)
    assert plan.fit.target_weights_bytes == 12_345 * 4  # its own size, not the catalogue's
    # this target is tiny: every qwen2.5 draft model would be larger than it
    assert plan.choice.kind == "ngram" and plan.refused
    assert all(o.reason.startswith("too large to pay off") for o in plan.refused)


def test_an_unknown_target_is_refused_with_what_to_give(catalogue):
    with pytest.raises(SpecdeckError, match="pair id or model from `specdeck models`"):
        target_info.describe("no/such-model", catalogue)


@pytest.mark.slow
def test_a_real_gguf_header_gives_the_real_numbers(smollm2_gguf, catalogue):
    info = target_info.describe(str(smollm2_gguf), catalogue)
    assert (info.arch.layers, info.arch.kv_heads, info.arch.head_dim, info.arch.vocab) == \
        (30, 3, 64, 49152)
    assert info.params == 134_515_008 and info.family == "smollm2"
    assert sizing.kv_bytes_per_token(info.arch, 4) == 30 * 3 * 64 * 2 * 4 == 46_080


# ---- --target PAIR and --drafter auto ------------------------------------------------


def install_folder(model_id: str, tiny) -> None:
    """Lay a tiny HF model where the store puts an installed model (its documented layout)."""
    folder = store.model_dir(model_id, "torch")
    tiny.hf.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    (folder / store.MARKER).write_text(json.dumps({"load": "."}))


def engine_args(target: str, drafter: str, no_history: bool = False,
                backend: str = "torch") -> SimpleNamespace:
    return SimpleNamespace(target=target, drafter=drafter, draft=None, k=3, backend=backend,
                           device="cpu", dtype="float32", no_history=no_history)


def test_generate_accepts_an_installed_pair_id_and_auto_picks_its_draft(
        tmp_path, monkeypatch, target, unrelated):
    from app.loading import load_engine

    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    monkeypatch.setattr(planner, "available_memory", lambda *_: 64 * GB)
    pair = "qwen2.5-coder-1.5b+0.5b"
    with pytest.raises(SpecdeckError, match=re.escape(f"run `specdeck pull {pair}`")):
        load_engine(engine_args(pair, "auto"))
    install_folder("qwen2.5-coder-1.5b-instruct-q4km", target)
    ngram = load_engine(engine_args(pair, "auto", no_history=True))
    assert ngram.drafter_name == "ngram"
    assert any("is not downloaded" in note for note in ngram.notes)
    # with the history on (the default), model-free lookup also reads past replies
    assert load_engine(engine_args(pair, "auto")).drafter_name == "suffix"
    install_folder("qwen2.5-coder-0.5b-instruct-q4km", unrelated)
    loaded = load_engine(engine_args(pair, "auto"))
    assert loaded.drafter_name == "chain"  # the pair's draft model, behind prompt lookup
    assert loaded.notes[0].startswith("drafter: draft qwen2.5-coder-0.5b-instruct-q4km")
    assert load_engine(engine_args(pair, "draft")).drafter_name == "draft"
    # --backend auto (every surface's default) plans for the backend it detects
    assert load_engine(engine_args(pair, "auto", backend="auto")).drafter_name == "chain"


def test_a_4_bit_gguf_on_a_cpu_with_avx512_vnni_plans_w4a8_and_an_8_bit_source_never(
        catalogue, monkeypatch):
    monkeypatch.setattr("backends.cpu.cpu_has_w4a8", lambda: True)
    fit = sizing.pair_fit(catalogue.pair("qwen2.5-coder-1.5b+0.5b"), "torch", "cpu", 16 * GB,
                           4096)
    params = catalogue.model("qwen2.5-coder-1.5b-instruct-q4km").params
    assert fit.dtype == "w4a8"
    assert fit.target_weights_bytes == int(params * 0.625)
    assert hardware.dtype_for("torch", "cpu", "gguf-q8_0") not in ("int4", "w4a8")


def _trained_eagle3(tmp_path: Path, tau: float | None) -> Path:
    folder = tmp_path / f"head-{tau}"
    folder.mkdir()
    if tau is not None:
        (folder / "specdeck.json").write_text(json.dumps({"held_out_tau": tau}))
    return folder


def test_a_head_whose_recorded_tau_promises_nothing_is_passed_over_with_the_reason(
        catalogue, tmp_path):
    head = _trained_eagle3(tmp_path, 1.008)
    installed = {"eagle3-qwen3-4b": head, "qwen3-0.6b": Path("/models/qwen3-0.6b")}
    plan = planner.plan("qwen3-4b", "torch", "cuda", 40 * GB, catalogue=catalogue,
                        runs=building("draft", "eagle3"),
                        installed=lambda m: installed.get(m.id))
    assert plan.choice.kind == "draft"
    eagle = next(o for o in plan.refused if o.kind == "eagle3")
    assert "held-out τ of 1.008" in eagle.reason and "train-head" in eagle.reason


def test_a_head_whose_recorded_tau_pays_or_that_has_no_record_is_still_chosen(
        catalogue, tmp_path):
    for tau in (1.6, None):
        head = _trained_eagle3(tmp_path, tau)
        plan = planner.plan("qwen3-4b", "torch", "cuda", 40 * GB, catalogue=catalogue,
                            runs=building("draft", "eagle3"),
                            installed=lambda m, head=head: head if m.id == "eagle3-qwen3-4b"
                            else Path("/models") / m.id)
        assert plan.choice.kind == "eagle3", tau


def test_a_gguf_cut_short_after_its_magic_is_refused_naming_the_fix(tmp_path, catalogue):
    partial = tmp_path / "partial.gguf"
    partial.write_bytes(b"GGUF")
    with pytest.raises(SpecdeckError, match="download it again"):
        target_info.describe(str(partial), catalogue)


def test_a_gguf_on_a_cpu_with_its_kernel_plans_the_files_bytes_and_a_float32_cache(
        catalogue, monkeypatch):
    monkeypatch.setattr(hardware, "_gguf_runs_here", lambda: True)
    pair = catalogue.pair("qwen2.5-coder-1.5b+0.5b")
    fit = sizing.pair_fit(pair, "torch", "cpu", 16 * GB, 4096)
    target_file = pair.target.download_bytes("torch")[0]
    draft_file = pair.drafter.download_bytes("torch")[0]
    light_head = int(151_936 * 896 * 0.625)  # the draft's 4-bit output layer it drafts with
    assert fit.dtype == "gguf"
    assert (fit.target_weights_bytes, fit.drafter_weights_bytes) == (target_file,
                                                                     draft_file + light_head)
    assert (fit.target_kv_per_token, fit.drafter_kv_per_token) == (57_344, 24 * 2 * 64 * 2 * 4)
    assert fit.memory_bytes == (400 * 2**20 + target_file + draft_file + light_head
                                + 4096 * (57_344 + 24_576))


def test_a_local_gguf_is_planned_at_its_size_on_disk(tmp_path, catalogue, monkeypatch):
    monkeypatch.setattr(hardware, "_gguf_runs_here", lambda: True)
    torch = pytest.importorskip("torch")  # noqa: F841 - tests.tiny builds the file with it
    from gguf import GGMLQuantizationType

    from tests.tiny import save_gguf, tiny_llama

    path = save_gguf(tiny_llama(seed=1), tmp_path / "tiny.gguf", int(GGMLQuantizationType.Q8_0))
    plan = planner.plan(str(path), "torch", "cpu", 16 * GB, catalogue=catalogue)
    assert plan.fit.dtype == "gguf"
    assert plan.fit.target_weights_bytes == path.stat().st_size


# ---- the drafter's memory: weights, verify state, KV per token, servable context -----------


def test_the_dspark_pairs_verify_state_and_kv_cache_match_the_hand_computation(catalogue):
    fit = sizing.pair_fit(catalogue.pair("qwen3-4b+dspark"), "torch", "cuda", 40 * GB, 4096)
    assert fit.dtype == "bfloat16"
    assert fit.drafter_weights_bytes == 1_394_000_000 * 2
    assert fit.drafter_kv_per_token == 5 * 8 * 128 * 2 * 2 == 20_480  # five drafter layers
    # k 7 drafts and the anchor: 8 rows, each float32 logits over 151936 tokens and the five
    # captured target layers' hidden states in bf16
    assert fit.verify_rows == 8
    assert fit.verify_bytes == 8 * (151_936 * 4 + 5 * 2560 * 2) == 5_066_752
    assert dict(fit.rows())["verify state"] == "5.1 MB (8 rows)"
    assert dict(fit.rows())["KV per token"] == "144.0 KiB target + 20.0 KiB drafter"


def test_medusa_heads_keep_no_kv_cache_and_an_eagle3_head_captures_three_layers(catalogue):
    medusa = sizing.pair_fit(catalogue.pair("vicuna-7b+medusa"), "torch", "cuda", 40 * GB, 2048)
    assert medusa.drafter_kv_per_token == 0 and medusa.drafter_weights_bytes > 0
    eagle3 = sizing.pair_fit(catalogue.pair("qwen3-4b+eagle3"), "torch", "cuda", 40 * GB, 4096)
    assert eagle3.verify_bytes == 7 * (151_936 * 4 + 3 * 2560 * 2)
    ngram = sizing.pair_fit(catalogue.pair("smollm2-135m+ngram"), "torch", "cuda", GB, 4096)
    assert (ngram.drafter_weights_bytes, ngram.drafter_kv_per_token) == (0, 0)
    assert ngram.verify_bytes == 5 * 49_152 * 4  # logits only: it reads no hidden state


def test_the_planners_order_is_data_and_every_kind_in_it_has_a_place_and_a_reason():
    kinds = [rank.name for rank in preference.PREFERENCE]
    assert len(kinds) == len(set(kinds)) and all(rank.why for rank in preference.PREFERENCE)
    assert preference.HEAD_KINDS == ("dspark", "dflash", "eagle3", "eagle", "medusa")
    assert preference.MODEL_FREE == {"lookahead", "ngram"}


def test_models_why_prints_the_pairs_memory_rows_and_its_unverified_sources(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    rows = store.list_pairs("torch", "cuda", 40 * GB, 4096)
    text = models_table(rows, 4096, why=True)
    block = text.split("\nqwen3-4b+dspark")[1].split("\nqwen3-8b+dspark")[0]
    assert ("    unverified: deepseek-ai/dspark_qwen3_4b_block7: id and files from DeepSpec's "
            "README, not checked on the hub") in block
    assert ("    memory with dspark: target weights 8.04 GB; drafter weights 2.79 GB; verify "
            "state 5.1 MB (8 rows); KV per token 144.0 KiB target + 20.0 KiB drafter; "
            "servable context 40960 plain / 40960 with the drafter") in block
    assert "unverified" not in models_table(rows, 4096).split("\nsmollm2")[1].split("\n")[1]
    dspark = next(r for r in rows if r.pair.id == "qwen3-4b+dspark").to_dict()
    assert dspark["unverified"] == ["deepseek-ai/dspark_qwen3_4b_block7: id and files from "
                                    "DeepSpec's README, not checked on the hub"]
    assert dspark["fit"]["verify_rows"] == 8


QWEN36_27B_TEXT = {  # the 27B qwen3_5 text config as public sources quote it
    "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24,
    "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
    "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def test_a_catalogue_hybrid_reads_as_its_config_json_would(catalogue):
    from_config = target_info.arch_from_config({"model_type": "qwen3_5",
                                                "text_config": QWEN36_27B_TEXT})
    assert catalogue.models["qwen3.6-27b"].arch == from_config
    assert from_config.kv_layers == 16 and len(from_config.stream.layers) == 48


def test_models_counts_a_hybrid_pairs_state_slots_as_the_planner_does(catalogue):
    pair = catalogue.pairs["qwen3.6-27b+mtp"]
    chosen = planner.plan(pair.id, memory=200 * GB, context=8192, catalogue=catalogue)
    listed = sizing.pair_fit(pair, "torch", "cpu", 200 * GB, 8192)
    assert chosen.choice.kind == "mtp" and chosen.choice.k == pair.k
    assert listed.slot_bytes == chosen.fit.slot_bytes > 0
    assert listed.streams_spec == chosen.fit.streams_spec < listed.streams_plain


def test_a_gemma_assistant_pair_keeps_no_drafter_kv_cache(catalogue):
    # the assistant's four layers read the target's keys and values
    listed = sizing.pair_fit(catalogue.pairs["gemma-4-31b+assistant"], "torch", "cpu", 400 * GB,
                             4096)
    assert listed.drafter_kv_per_token == 0 and listed.drafter_weights_bytes > 0


def test_gemma_4_and_gpt_oss_configs_read_as_the_catalogue_has_them(catalogue):
    # E4B's last 18 layers reuse earlier layers' keys and values: 24 keep their own, 20 of
    # them sliding; its full layers' heads are 512 wide (the values of its public config)
    e4b = {"model_type": "gemma4", "text_config": {
        "hidden_size": 2560, "num_hidden_layers": 42, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 262144,
        "max_position_embeddings": 131072, "num_kv_shared_layers": 18,
        "sliding_window": 512, "global_head_dim": 512, "attention_k_eq_v": False,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7}}
    assert target_info.arch_from_config(e4b) == catalogue.models["gemma-4-e4b"].arch
    gemma_31b = {"model_type": "gemma4", "text_config": {
        "hidden_size": 5376, "num_hidden_layers": 60, "num_attention_heads": 32,
        "num_key_value_heads": 16, "num_global_key_value_heads": 4, "head_dim": 256,
        "global_head_dim": 512, "attention_k_eq_v": True, "vocab_size": 262144,
        "max_position_embeddings": 262144, "sliding_window": 1024, "num_kv_shared_layers": 0,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10}}
    assert target_info.arch_from_config(gemma_31b) == catalogue.models["gemma-4-31b"].arch
    gpt_oss = {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24,
               "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
               "vocab_size": 201088, "max_position_embeddings": 131072,
               "num_local_experts": 32, "intermediate_size": 2880, "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 12}
    assert target_info.arch_from_config(gpt_oss) == catalogue.models["gpt-oss-20b"].arch
