"""Native MTP layers: tiny random targets written with the published names (GLM-4.5 /
DeepSeek-V3 `model.layers.{N}.{enorm,hnorm,eh_proj,shared_head}` with per-expert MoE names,
MiMo `model.mtp_layers.0.*` on Qwen2) are detected at load and drafted with on torch and on
MLX (mlx-lm's glm4_moe and mimo layers); speculative output equals plain decoding (greedy
oracle at k 1, 2, 4, 7; sampled output keeps the target's law); MLX drafts the chains torch
drafts; a target with recurrent layers is refused with that reason."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)

from app.catalogue import planner  # noqa: E402
from app.core.engine import SpecEngine  # noqa: E402
from app.core.feed import StepFeed  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends.heads.mtp_format import detect_mtp, read_layout  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from backends.torch.head_weights.mtp import load_mtp_drafter  # noqa: E402
from tests.distributions import assert_first_two_follow  # noqa: E402
from tests.fakes import RecordingDrafter  # noqa: E402
from tests.marks import heavy  # noqa: E402
from tests.tiny import tiny_tokenizer  # noqa: E402

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9, 12]
HIDDEN = 32
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                               reason="mlx-lm is not installed")
BACKENDS = ("torch", pytest.param("mlx", marks=needs_mlx))


def glm_folder(root: Path, vocab: int = 48, seed: int = 0) -> Path:
    """A GLM-4.5-style target of 2 layers whose checkpoint also holds layer 2: the MTP layer
    (an MoE decoder layer, saved by transformers under the per-expert names), plus its enorm,
    hnorm, eh_proj and shared_head tensors, and num_nextn_predict_layers in the config."""
    torch.manual_seed(seed)
    config = Glm4MoeConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64,
                           moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           max_position_embeddings=256, eos_token_id=1, bos_token_id=0)
    model = Glm4MoeForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    folder = root / f"glm-{vocab}"
    model.save_pretrained(folder)
    tiny_tokenizer(vocab).save_pretrained(folder)
    extra = {"model.layers.2.enorm.weight": 1 + 0.1 * torch.randn(HIDDEN),
             "model.layers.2.hnorm.weight": 1 + 0.1 * torch.randn(HIDDEN),
             "model.layers.2.eh_proj.weight": 0.2 * torch.randn(HIDDEN, 2 * HIDDEN),
             "model.layers.2.shared_head.norm.weight": 1 + 0.1 * torch.randn(HIDDEN)}
    save_file(extra, str(folder / "mtp.safetensors"))
    # the RoPE keys where GLM-4.5's published config.json keeps them (mlx-lm reads them there)
    _edit_config(folder, num_hidden_layers=2, num_nextn_predict_layers=1, rope_theta=10000.0,
                 partial_rotary_factor=0.5, rope_scaling=None)
    return folder


def mimo_folder(root: Path) -> Path:
    """A MiMo-style target: Qwen2 layers, the MTP layer under model.mtp_layers.0 with its
    token_layernorm, hidden_layernorm, input_proj and final_layernorm."""
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=48, hidden_size=HIDDEN, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=1, bos_token_id=0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    folder = root / "mimo"
    model.save_pretrained(folder)
    tiny_tokenizer(48).save_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    renamed = {k.replace("model.layers.2.", "model.mtp_layers.0."): v for k, v in state.items()}
    renamed.update({"model.mtp_layers.0.token_layernorm.weight": torch.ones(HIDDEN),
                    "model.mtp_layers.0.hidden_layernorm.weight": torch.ones(HIDDEN),
                    "model.mtp_layers.0.input_proj.weight": 0.2 * torch.randn(HIDDEN, 2 * HIDDEN),
                    "model.mtp_layers.0.final_layernorm.weight": torch.ones(HIDDEN)})
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(folder, num_hidden_layers=2, num_nextn_predict_layers=1)
    return folder


def qwen3_5_folder(root: Path, moe: bool = False, vocab: int = 48) -> Path:
    """A Qwen3.5-style hybrid target (a Gated DeltaNet layer, then full attention; MoE layers
    where moe) whose checkpoint holds the MTP block under `mtp.`: the full-attention layer
    saved as layer 2, renamed `mtp.layers.0.`, beside pre_fc_norm_embedding,
    pre_fc_norm_hidden, fc and norm ((1 + w) norms: small w), and mtp_num_hidden_layers in the
    config, as Qwen3.5 ships it."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from tests.tiny_families import _COMMON, _LINEAR

    torch.manual_seed(2)
    sizes = {**_COMMON, **_LINEAR, "vocab_size": vocab, "num_hidden_layers": 3,
             "layer_types": ["linear_attention", "full_attention", "full_attention"]}
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        **sizes, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16)) if moe else \
        Qwen3_5ForCausalLM(Qwen3_5TextConfig(**sizes, intermediate_size=64))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    folder = root / f"{'qwen3_5_moe' if moe else 'qwen3_5'}{'' if vocab == 48 else vocab}"
    model.save_pretrained(folder)
    tiny_tokenizer(vocab).save_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    renamed = {k.replace("model.layers.2.", "mtp.layers.0."): v for k, v in state.items()}
    renamed.update({f"mtp.{name}.weight": 0.1 * torch.randn(HIDDEN)
                    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    renamed["mtp.fc.weight"] = 0.2 * torch.randn(HIDDEN, 2 * HIDDEN)
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(folder, num_hidden_layers=2, mtp_num_hidden_layers=1)
    return folder


def multimodal_folder(folder: Path) -> Path:
    """The text-only Qwen3.5 folder as Qwen3.5's published checkpoints lay it out: model_type
    qwen3_5 with a text_config, `model.language_model.*` tensors, `mtp.*` beside them."""
    laid = folder.with_name(f"{folder.name}-vl")
    if laid.exists():
        return laid
    laid.mkdir()
    text = json.loads((folder / "config.json").read_text())
    (laid / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False,
        "architectures": ["Qwen3_5ForConditionalGeneration"]}))
    stored = load_file(str(folder / "model.safetensors"))
    save_file({k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k:
               v for k, v in stored.items()}, str(laid / "model.safetensors"))
    for file in folder.iterdir():
        if file.name.startswith("tokenizer") or file.name == "special_tokens_map.json":
            shutil.copy(file, laid / file.name)
    return laid


def mlx_folder(folder: Path) -> Path:
    """The folder as MLX loads it: a MiMo folder says model_type mimo, as MiMo's published
    config does (transformers has no MiMo class, so torch loads it as the Qwen2 it is)."""
    if json.loads((folder / "config.json").read_text())["model_type"] != "qwen2":
        return folder
    copy = folder.with_name(f"{folder.name}-mlx")
    if copy.exists():
        return copy
    shutil.copytree(folder, copy)
    _edit_config(copy, num_hidden_layers=2, model_type="mimo",
                 architectures=["MiMoForCausalLM"])
    return copy


def load(backend: str, folder: Path):
    """The target of folder on backend, in float32 on the CPU."""
    if backend == "mlx":
        from backends.mlx.backend import MlxBackend

        return MlxBackend().load(str(mlx_folder(folder)), device="cpu", dtype="float32")
    return TorchBackend().load(str(folder), device="cpu", dtype="float32")


def backend_of(name: str):
    if name == "mlx":
        from backends.mlx.backend import MlxBackend

        return MlxBackend()
    return TorchBackend()


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:changes["num_hidden_layers"]]
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {"glm": glm_folder(root), "mimo": mimo_folder(root), "qwen3_5": qwen3_5_folder(root),
            "qwen3_5_moe": qwen3_5_folder(root, moe=True)}


@pytest.fixture(scope="module")
def targets(folders):
    return {name: load("torch", f) for name, f in folders.items()}


@pytest.fixture(scope="module")
def on(folders, request):
    """(backend name, {layout: target}) for each backend."""
    return request.param, {name: load(request.param, f) for name, f in folders.items()}


def test_mtp_layouts_are_detected_from_config_and_tensor_names(folders):
    assert read_layout(folders["glm"])[1].prefixes == ("model.layers.2.",)
    assert read_layout(folders["glm"])[1].style == "deepseek"
    assert read_layout(folders["mimo"])[1].style == "mimo"
    qwen_next = detect_mtp({"num_hidden_layers": 4, "num_nextn_predict_layers": 1},
                           ["mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight"])
    assert qwen_next.style == "qwen3_next"
    assert detect_mtp({"num_hidden_layers": 4}, ["mtp.fc.weight"]) is None


def test_the_qwen3_5_mtp_block_is_fc_over_the_normed_embedding_then_hidden(folders, targets):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    target = targets["qwen3_5"]
    stored = load_file(str(folders["qwen3_5"] / "model.safetensors"))
    reference = Qwen3_5DecoderLayer(target.hf.config, layer_idx=1).eval()  # full attention
    reference.load_state_dict({k.removeprefix("mtp.layers.0."): v for k, v in stored.items()
                               if k.startswith("mtp.layers.0.")})
    drafter = load_mtp_drafter(target)
    hidden, embeds = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    positions = torch.arange(5)[None]

    def norm(x, name):  # Qwen3.5's RMSNorm scales by 1 + w
        w = stored[f"mtp.{name}.weight"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)

    fused = torch.cat([norm(embeds, "pre_fc_norm_embedding"),
                       norm(hidden, "pre_fc_norm_hidden")], -1) @ stored["mtp.fc.weight"].T
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    args = {"position_ids": positions, "attention_mask": mask,
            "position_embeddings": target.hf.model.rotary_emb(fused[None], positions)}
    with torch.inference_mode():
        ours = drafter.step.layer(hidden, embeds, **args)
        theirs = norm(reference(fused[None], **args)[0], "norm")
    torch.testing.assert_close(ours, theirs)


def test_the_planner_says_native_mtp_for_a_local_target_that_carries_it(folders):
    plan = planner.plan(str(folders["glm"]), "torch", "cpu", 10**12)
    assert plan.choice.kind == "mtp"
    assert plan.choice.reason.startswith("the target carries 1 native MTP layer(s)")


def test_the_glm_mtp_block_with_per_expert_names_equals_transformers_own_layer(folders, targets):
    reference = AutoModelForCausalLM.from_pretrained(folders["glm"], num_hidden_layers=3,
                                                     dtype=torch.float32).eval()
    drafter = load_mtp_drafter(targets["glm"])
    x = torch.randn(1, 5, HIDDEN)
    positions = torch.arange(5)[None]
    args = {"position_ids": positions,
            "position_embeddings": reference.model.rotary_emb(x, positions)}
    with torch.inference_mode():
        ours = drafter.step.layer.layer(x, **args)
        theirs = reference.model.layers[2](x, **args)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("on", BACKENDS, indirect=True)
@pytest.mark.parametrize("name", ["glm", "mimo", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_greedy_mtp_gives_exactly_the_oracles_tokens(on, name, k):
    backend, targets = on
    target = targets[name]
    plain = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=30)))[-1]
    drafter = build_drafter("mtp", target, backend=backend_of(backend))
    done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=30),
                                            drafter=drafter, k=k))[-1]
    assert done.error is None
    assert done.token_ids == plain.token_ids
    assert done.stats.drafted > 0


@pytest.mark.parametrize("on", BACKENDS, indirect=True)
@pytest.mark.parametrize("name", ["glm", "mimo", "qwen3_5"])
def test_a_drafted_chain_is_k_long_and_its_cache_keeps_committed_pairs_only(on, name):
    backend, targets = on
    target = targets[name]
    drafter = build_drafter("mtp", target, backend=backend_of(backend))
    out = target.start().forward(PROMPT, n_logits=1, capture=drafter.capture_layers)
    drafter.begin(PROMPT, StepFeed.prompt(PROMPT, out, 3), SamplingParams(), None)
    first = drafter.propose([*PROMPT, 3], 4)
    assert len(first.tokens) == 4 and first.parents is None
    assert drafter.step.length == len(PROMPT)  # prompt pairs and the pending one
    assert drafter.propose([*PROMPT, 3], 4) == first  # drafting left no trace


class Recording(RecordingDrafter):
    """The drafter, with every proposed chain and every state it drafts from kept."""

    def __init__(self, inner):
        super().__init__(inner)
        self.states = []

    @property
    def chains(self):
        return [d.tokens for d in self.drafts]

    def propose(self, context, k):
        self.states.append(np.array(self.inner.arrays.to_numpy(self.inner._last)))
        return super().propose(context, k)


@needs_mlx
@pytest.mark.parametrize("name", ["glm", "mimo", "qwen3_5", "qwen3_5_moe"])
def test_mlx_drafts_the_chains_torch_drafts_from_the_same_states(folders, name):
    runs = {}
    for backend in ("torch", "mlx"):
        target = load(backend, folders[name])
        drafter = Recording(build_drafter("mtp", target, backend=backend_of(backend)))
        done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=24),
                                                drafter=drafter, k=4))[-1]
        runs[backend] = done.token_ids, drafter.chains, drafter.states
    assert runs["mlx"][:2] == runs["torch"][:2]
    assert len(runs["mlx"][1]) > 3
    for mlx_state, torch_state in zip(runs["mlx"][2], runs["torch"][2]):
        np.testing.assert_allclose(mlx_state, torch_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen3_5s_multimodal_layout_drafts_the_chains_of_its_text_only_layout(folders, backend):
    runs = []
    for folder in (folders["qwen3_5"], multimodal_folder(folders["qwen3_5"])):
        target = load(backend, folder)
        drafter = Recording(build_drafter("mtp", target, backend=backend_of(backend)))
        done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=16),
                                                drafter=drafter, k=3))[-1]
        runs.append((done.token_ids, drafter.chains))
    assert runs[0] == runs[1] and len(runs[0][1]) > 2


@pytest.mark.heavy  # 500 sampled generations
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_mtp_commits_tokens_from_the_targets_own_distribution(tmp_path, backend):
    vocab = 4
    target = load(backend, glm_folder(tmp_path, vocab=vocab, seed=5))
    target.eos_token_ids = frozenset()
    drafter = build_drafter("mtp", target, backend=backend_of(backend))  # begin() resets it
    assert_first_two_follow(target, drafter, [2, 3], vocab, n=500)


@pytest.mark.heavy  # 500 sampled generations
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_qwen3_5_mtp_on_its_recurrent_target_commits_the_targets_distribution(
        tmp_path, backend):
    """The hybrid target rewinds its DeltaNet state past a rejected draft token, and the
    MTP block drafts from the kept row's hidden state: what is committed is still sampled
    from the target's own law."""
    vocab = 4
    target = load(backend, qwen3_5_folder(tmp_path, vocab=vocab))
    target.eos_token_ids = frozenset()
    drafter = build_drafter("mtp", target, backend=backend_of(backend))
    assert_first_two_follow(target, drafter, [2, 3], vocab, n=500)


def test_a_target_without_mtp_layers_is_refused_naming_another_drafter(target):
    with pytest.raises(SpecdeckError, match="has no native MTP layers.*--drafter ngram"):
        build_drafter("mtp", target, backend=TorchBackend())


@needs_mlx
def test_an_mlx_target_without_mtp_layers_is_refused_naming_another_drafter(mlx_target):
    with pytest.raises(SpecdeckError, match="has no native MTP layers.*--drafter ngram"):
        build_drafter("mtp", mlx_target, backend=backend_of("mlx"))


def test_a_recurrent_target_without_mtp_layers_is_refused_mtp_and_runs_lookup():
    from tests.tiny_families import tiny_family

    target = tiny_family("qwen3_next")
    with pytest.raises(SpecdeckError, match=f"{target.name} has no native MTP layers"):
        build_drafter("mtp", target, backend=TorchBackend())
    for kind in ("ngram", "lookahead", "none"):
        assert build_drafter(kind, target, backend=TorchBackend()).name == kind
