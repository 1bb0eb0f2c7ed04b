"""DSpark block drafters, on torch and on MLX (its CPU build here): a tiny random drafter in
DeepSpec's layout proposes, round by round, the blocks and confidences DeepSpec's own decoding
loop proposed (golden values made by tests/fixtures/dspark/make_golden.py), with its
confidence cut-off too; both backends draft the same blocks; speculators' DSpark format loads
the same drafter; speculative output equals plain decoding (greedy oracle at k 1, 2, 4, 7;
sampled output keeps the target's law); the cut-off changes which tokens are verified, never
the output; checkpoints it cannot run are refused naming why, and a DeepSeek-V4 checkpoint's
DSpark stages are never taken for MTP layers."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from app.catalogue.target_info import arch_from_config  # noqa: E402
from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError, Step  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends import load_backend  # noqa: E402
from backends.heads.mtp_format import detect_mtp  # noqa: E402
from tests.distributions import assert_follows, second_token_law, second_tokens  # noqa: E402
from tests.fakes import RecordingDrafter  # noqa: E402
from tests.marks import heavy  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "dspark"
TARGET = Path(__file__).parent / "fixtures" / "dflash" / "target"
GOLDEN = json.loads((FIX / "golden.json").read_text())
RUNS = {run["threshold"]: run for run in GOLDEN["runs"]}
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                               reason="mlx-lm is not installed")
BACKENDS = ("torch", pytest.param("mlx", marks=needs_mlx))


def load_target(name: str):
    return load_backend(name).load(str(TARGET), device="cpu", dtype="float32")


@pytest.fixture(scope="module", params=BACKENDS)
def on(request):
    """(backend, its target) for each backend."""
    return load_backend(request.param), load_target(request.param)


@pytest.fixture(scope="module")
def target():
    return load_target("torch")


def dspark(on, folder: str | Path = FIX / "drafter", threshold: float = 0.0):
    """The DSpark drafter of a folder on `on`'s target, cut at `threshold`."""
    backend, target = on
    module = importlib.import_module(f"backends.{backend.name}.head_weights.dspark")
    return module.load_dspark_drafter(target, str(folder), threshold)


def generate(target, drafter, k=4, max_new_tokens=24):
    return list(SpecEngine(target).generate(GOLDEN["prompt"], SamplingParams(
        max_new_tokens=max_new_tokens), drafter=drafter, k=k))


@pytest.mark.parametrize("threshold", sorted(RUNS))
def test_each_round_drafts_the_tokens_deepspec_drafted(on, threshold):
    _, target = on
    golden = RUNS[threshold]
    drafter = RecordingDrafter(dspark(on, threshold=threshold))
    events = generate(target, drafter)
    assert list(GOLDEN["prompt"]) + list(events[-1].token_ids) == golden["output_ids"]
    steps = [e for e in events if isinstance(e, Step)][1:]  # after the prefill's token
    rounds = len(golden["rounds"]) - 1  # the last round's k is capped by the tokens left
    assert [len(s.tokens) for s in steps][:rounds] == golden["acceptance_lengths"][:rounds]
    assert [list(d.tokens) for d in drafter.drafts][:rounds] == \
        [r["proposed"] for r in golden["rounds"]][:rounds]


def test_the_draft_carries_the_confidence_heads_prefix_survival(on):
    _, target = on
    golden = RUNS[0.0]["rounds"]
    drafter = RecordingDrafter(dspark(on))
    generate(target, drafter)
    for draft, round_ in zip(drafter.drafts[:len(golden) - 1], golden):
        assert draft.survival == pytest.approx(np.cumprod(round_["confidence"]), rel=1e-4)


def test_the_speculators_format_loads_the_same_drafter(on, tmp_path):
    _, target = on
    folder = tmp_path / "speculators"
    shutil.copytree(FIX / "drafter", folder)
    raw = json.loads((folder / "config.json").read_text())
    layer = {k: v for k, v in raw.items() if k not in (
        "architectures", "block_size", "target_layer_ids", "mask_token_id", "num_anchors",
        "markov_rank", "markov_head_type", "enable_confidence_head",
        "confidence_head_with_markov", "num_target_layers")}
    (folder / "config.json").write_text(json.dumps({
        "speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
        "transformer_layer_config": layer, "block_size": raw["block_size"],
        "mask_token_id": raw["mask_token_id"], "markov_rank": raw["markov_rank"],
        "aux_hidden_state_layer_ids": [i + 1 for i in raw["target_layer_ids"]],
        "draft_vocab_size": raw["vocab_size"]}))  # sample_from_anchor absent: True
    drafter = RecordingDrafter(dspark(on, folder))
    generate(target, drafter)
    golden = RUNS[0.0]["rounds"]
    assert [list(d.tokens) for d in drafter.drafts][:len(golden) - 1] == \
        [r["proposed"] for r in golden][:len(golden) - 1]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_confidence_cut_off_changes_which_tokens_are_verified_never_the_output(on, k):
    _, target = on
    outputs, drafted = [], []
    for threshold in (0.0, 0.5, 0.9):
        drafter = dspark(on, threshold=threshold)
        done = generate(target, drafter, k=k, max_new_tokens=30)[-1]
        outputs.append(done.token_ids)
        drafted.append(done.stats.drafted)
    assert outputs[0] == outputs[1] == outputs[2]
    assert drafted[0] > drafted[1] > drafted[2]


def test_dspark_runs_through_each_backends_factory(on):
    backend, target = on
    drafter = build_drafter("dspark", target, backend=backend, head=str(FIX / "drafter"))
    assert drafter.name == "dspark" and drafter.max_drafts == 4  # row j: anchor + j + 1


@needs_mlx
@pytest.mark.parametrize("threshold", sorted(RUNS))
def test_mlx_drafts_the_blocks_torch_drafts_and_commits_the_same_tokens(threshold):
    runs = {}
    for name in ("torch", "mlx"):
        on = (load_backend(name), load_target(name))
        drafter = RecordingDrafter(dspark(on, threshold=threshold))
        done = generate(on[1], drafter, k=4, max_new_tokens=20)[-1]
        runs[name] = (done.token_ids, [d.tokens for d in drafter.drafts],
                      [d.survival for d in drafter.drafts])
    assert runs["mlx"][:2] == runs["torch"][:2]
    for mlx, torch_ in zip(runs["mlx"][2], runs["torch"][2]):
        assert mlx == pytest.approx(torch_, rel=1e-4)


@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_greedy_dspark_gives_exactly_the_oracles_tokens(on, k):
    _, target = on
    prompt = GOLDEN["prompt"]
    plain = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=30)))[-1]
    done = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=30),
                                            drafter=dspark(on), k=k))[-1]
    assert done.token_ids == plain.token_ids
    assert 0 < done.stats.drafted <= min(k, 4) * done.stats.target_forwards  # block 4: k <= 4


@pytest.mark.heavy  # 500 sampled generations
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_sampled_dspark_commits_tokens_from_the_targets_own_distribution(backend, threshold):
    target = load_target(backend)
    target.eos_token_ids = frozenset()  # every generation runs to its length
    prompt, n = [2, 3], 500
    expected = second_token_law(target, prompt)
    drafter = dspark((load_backend(backend), target), threshold=threshold)  # begin() resets
    assert_follows(second_tokens(target, prompt, drafter, n), expected * n)


def test_a_folder_missing_a_tensor_is_refused_naming_it(on, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    shutil.copytree(FIX / "drafter", folder)
    state = load_file(str(folder / "model.safetensors"))
    del state["markov_head.markov_w2.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(SpecdeckError, match=r"missing tensors \['markov_head.markov_w2.weight'"):
        dspark(on, folder)


def test_a_folder_whose_markov_rank_differs_from_its_tensors_is_refused(on, tmp_path):
    folder = tmp_path / "rank"
    shutil.copytree(FIX / "drafter", folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "markov_rank": 4}))
    with pytest.raises(SpecdeckError, match="its tensors do not match its config: size mismatch"):
        dspark(on, folder)


@pytest.mark.parametrize("change, message", [
    ({"markov_head_type": "gated"}, "markov_head_type 'gated' is not supported"),
    ({"markov_head_type": "rnn"}, "markov_head_type 'rnn' is not supported"),
    ({"target_layer_ids": [-1, 2]}, "include the embedding output"),
    ({"target_layer_ids": [0, 9]}, r"target_layer_ids \[9\] are outside"),
    ({"mask_token_id": None}, "lacks mask_token_id"),
])
def test_a_dspark_config_it_cannot_run_is_refused_naming_why(target, tmp_path, change, message):
    folder = tmp_path / "changed"
    shutil.copytree(FIX / "drafter", folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(change)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items()
                                                    if v is not None}))
    with pytest.raises(SpecdeckError, match=message):
        dspark((load_backend("torch"), target), folder)


def v4_config():
    """A DeepSeek-V4-style config whose DSpark stages sit under mtp.* (tiny numbers)."""
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
            "vocab_size": 48, "num_nextn_predict_layers": 3, "dspark_block_size": 3,
            "dspark_markov_rank": 8, "dspark_target_layer_ids": [1, 2, 3],
            "dspark_noise_token_id": 47, "hc_mult": 4, "n_routed_experts": 4}


def test_a_deepseek_v4_checkpoints_dspark_stages_are_refused_and_never_taken_for_mtp(
        target, tmp_path):
    keys = ["mtp.0.main_proj.weight", "mtp.0.attn.wq_a.weight", "mtp.2.markov_head.markov_w1",
            "mtp.2.hc_head_fn"]
    assert detect_mtp(v4_config(), keys) is None
    assert arch_from_config(v4_config()).mtp_layers == 0
    folder = tmp_path / "v4"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(v4_config()))
    with pytest.raises(SpecdeckError, match="DeepSeek-V4 DSpark stages .*MoE experts and "
                                            "hyper-connections"):
        dspark((load_backend("torch"), target), folder)


@pytest.mark.heavy  # k="auto" probes the verify costs first
def test_with_k_auto_the_survival_cut_keeps_the_plain_output(target):
    plain = list(SpecEngine(target).generate(GOLDEN["prompt"], SamplingParams(
        max_new_tokens=30)))[-1]
    drafter = RecordingDrafter(dspark((load_backend("torch"), target)))
    done = generate(target, drafter, k="auto", max_new_tokens=30)[-1]
    assert done.token_ids == plain.token_ids
    assert all(d.survival for d in drafter.drafts if d.tokens)


def test_asking_a_deepseek_v4_target_for_mtp_names_its_dspark_stages(tmp_path):
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from backends.torch.head_weights.mtp import load_mtp_drafter

    (tmp_path / "config.json").write_text(json.dumps(v4_config()))
    save_file({"mtp.0.main_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    target = SimpleNamespace(source=tmp_path, name="deepseek-v4-tiny")
    with pytest.raises(SpecdeckError, match="deepseek-v4-tiny carries DeepSeek-V4 DSpark stages "
                                            r"\(3 stages under mtp\.\*, block 3\), not MTP"):
        load_mtp_drafter(target)
