"""Qwen3.5 / 3.6 MTP layers published apart from their target: a tiny qwen3_5 target's `mtp.*`
tensors are split into a folder as mlx-vlm's split writes one (model_type qwen3_5_mtp, the
target's text_config, names without `mtp.`, norms as w + 1, MoE experts stacked), the target
is saved without them (as mlx-lm's conversion leaves it), and `--drafter mtp --draft DIR`
drafts with the folder: greedy output equals plain decoding and every chain equals the one
the same target drafts from its own `mtp.*` tensors (torch and MLX); the original checkpoint
serves as the folder too (vLLM's layout); a folder made for another target is refused naming
both; --drafter auto recognises the folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from app.drafters.kinds import check  # noqa: E402
from app.loading import load_engine  # noqa: E402
from app.pair import folder_head_kind  # noqa: E402
from tests.test_mtp import BACKENDS, PROMPT, Recording, backend_of, load, qwen3_5_folder  # noqa: E402

# the (1 + w) norms, which mlx-vlm's split stores as w + 1
NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def without_mtp(folder: Path) -> Path:
    """The target saved without its `mtp.*` tensors; its config still declares the layer."""
    bare = folder.with_name(f"{folder.name}-bare")
    if not bare.exists():
        shutil.copytree(folder, bare)
        stored = load_file(str(folder / "model.safetensors"))
        save_file({k: v for k, v in stored.items() if not k.startswith("mtp.")},
                  str(bare / "model.safetensors"), metadata={"format": "pt"})
    return bare


def split_mtp(folder: Path, **text_changes) -> Path:
    """The target's MTP layer as a folder of mlx-vlm's split layout (text_changes: keys of its
    text_config changed, to make one for another target)."""
    text = {**json.loads((folder / "config.json").read_text()), **text_changes}
    split = folder.with_name(f"{folder.name}-MTP{'-other' if text_changes else ''}")
    if split.exists():
        return split
    split.mkdir()
    (split / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5_mtp", "text_config": text, "block_size": 3,
        "tie_word_embeddings": False}))
    stored = load_file(str(folder / "model.safetensors"))
    save_file(_mlx_form({k.removeprefix("mtp."): v for k, v in stored.items()
                         if k.startswith("mtp.")}),
              str(split / "model.safetensors"), metadata={"format": "mlx"})
    return split


def _mlx_form(tensors: dict) -> dict:
    out = {k: v + 1.0 if k.endswith(NORMS) and v.ndim == 1 else v for k, v in tensors.items()}
    fused = "layers.0.mlp.experts."
    if f"{fused}gate_up_proj" in out:  # [E, 2I, H] -> switch_mlp's [E, I, H] halves
        gate, up = out.pop(f"{fused}gate_up_proj").chunk(2, dim=1)
        stacked = "layers.0.mlp.switch_mlp."
        out |= {f"{stacked}gate_proj.weight": gate.contiguous(),
                f"{stacked}up_proj.weight": up.contiguous(),
                f"{stacked}down_proj.weight": out.pop(f"{fused}down_proj")}
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-apart")
    return {"qwen3_5": qwen3_5_folder(root), "qwen3_5_moe": qwen3_5_folder(root, moe=True),
            "other": qwen3_5_folder(root, vocab=64)}


def run(backend: str, target, head: str | None):
    """(tokens, chains) of 16 greedy tokens at k 3 with the target's mtp drafter."""
    drafter = Recording(build_drafter("mtp", target, backend=backend_of(backend), head=head))
    done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=16),
                                            drafter=drafter, k=3))[-1]
    assert done.error is None
    return done.token_ids, drafter.chains


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("layout", ["split", "original"])
def test_an_mtp_folder_drafts_what_the_targets_own_layer_drafts(folders, backend, name, layout):
    folder = folders[name]
    head = split_mtp(folder) if layout == "split" else folder
    own = run(backend, load(backend, folder), None)
    bare = load(backend, without_mtp(folder))
    plain = list(SpecEngine(bare).generate(PROMPT, SamplingParams(max_new_tokens=16)))[-1]
    apart = run(backend, bare, str(head))
    assert apart[0] == plain.token_ids
    assert apart == own and len(own[1]) > 2


def test_the_target_without_its_tensors_is_still_refused_mtp_without_a_folder(folders):
    bare = load("torch", without_mtp(folders["qwen3_5"]))
    with pytest.raises(SpecdeckError, match="has no native MTP layers .*declares 1.*"
                                            "give --draft MTP_DIR"):
        build_drafter("mtp", bare, backend=backend_of("torch"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("made_for", [{"vocab_size": 64}, {"num_key_value_heads": 4}],
                         ids=["vocab", "heads"])
def test_a_folder_made_for_another_target_is_refused_naming_both(folders, backend, made_for):
    target = load(backend, without_mtp(folders["qwen3_5"]))
    head = split_mtp(folders["other"] if "vocab_size" in made_for else folders["qwen3_5"],
                     **made_for)
    key, value = next(iter(made_for.items()))
    with pytest.raises(SpecdeckError) as refused:
        build_drafter("mtp", target, backend=backend_of(backend), head=str(head))
    message = str(refused.value)
    assert str(head) in message and target.name in message
    assert f"{key} {value} against" in message


def test_a_quantized_folder_is_refused_before_loading(folders, tmp_path):
    head = tmp_path / "q-MTP-4bit"
    shutil.copytree(split_mtp(folders["qwen3_5"]), head)
    stored = load_file(str(head / "model.safetensors"))
    stored["fc.scales"] = torch.ones(32, 1)
    save_file(stored, str(head / "model.safetensors"))
    target = load("torch", without_mtp(folders["qwen3_5"]))
    with pytest.raises(SpecdeckError, match=r"quantized MTP layer \(fc\.scales"):
        build_drafter("mtp", target, backend=backend_of("torch"), head=str(head))


def test_the_folder_is_recognised_from_its_config_and_lets_mtp_run(folders):
    assert folder_head_kind(str(split_mtp(folders["qwen3_5"]))) == "mtp"
    assert folder_head_kind(str(folders["qwen3_5"])) is None  # a target, not an MTP folder
    assert check("mtp", mtp_layers=0, has_head=True) is None
    assert "needs MTP layers" in check("mtp", mtp_layers=0, has_head=False).message
    assert "this pair's head is eagle3" in check("mtp", has_head=True,
                                                  head_kind="eagle3").message


@pytest.mark.parametrize("drafter, head", [("auto", "split"), ("mtp", "original")])
def test_the_flags_load_the_folder_as_the_mtp_layer(folders, drafter, head):
    folder = folders["qwen3_5"]
    draft = split_mtp(folder) if head == "split" else folder
    loaded = load_engine(SimpleNamespace(
        k=3, target=str(without_mtp(folder)), drafter=drafter, draft=str(draft),
        backend="torch", device="cpu", dtype="float32", tree=False, no_history=True))
    assert loaded.drafter_name == "mtp" and loaded.draft is None
    done = list(loaded.engine.generate(PROMPT, SamplingParams(max_new_tokens=12)))[-1]
    plain = list(SpecEngine(loaded.engine.target).generate(
        PROMPT, SamplingParams(max_new_tokens=12)))[-1]
    assert done.token_ids == plain.token_ids and done.stats.drafted > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_on_a_target_whose_files_dropped_its_mtp_layers_falls_back_and_says_why(
        folders, backend):
    loaded = load_engine(SimpleNamespace(
        k="auto", target=str(without_mtp(folders["qwen3_5"])), drafter="auto", draft=None,
        backend=backend, device="cpu", dtype="float32", tree=False, no_history=True))
    assert loaded.drafter_name != "mtp"
    assert any("declares 1 MTP layer(s) but its files hold none" in note and "--draft MTP_DIR"
               in note for note in loaded.notes)
    done = list(loaded.engine.generate(PROMPT, SamplingParams(max_new_tokens=12)))[-1]
    assert done.error is None
