"""Gemma 4's assistant on MLX: greedy output identical to MLX plain decoding past the sliding
window, the first chain and its logits those of the torch assistant on the same weights
(plain and ordered embeddings), --drafter auto taking a given assistant folder, and the
refusals torch gives (a tiny random Gemma 4 target and assistant, fp32 on the CPU).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
torch = pytest.importorskip("torch")

from app.core.engine import SpecEngine  # noqa: E402
from app.core.feed import StepFeed  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from app.loading import load_engine  # noqa: E402
from backends.mlx.backend import MlxBackend  # noqa: E402
from backends.mlx.layouts import config_fixes  # noqa: E402
from backends.torch.backend import TorchBackend, TorchModel  # noqa: E402
from tests.fakes import RecordingDrafter  # noqa: E402
from tests.test_assistant import (  # noqa: E402
    _SIZES,
    PROMPT,
    assistant_folder,
    gemma4_target,
)
from tests.tiny import mlx_twin, save_hf_folder, tiny_llama, tiny_tokenizer  # noqa: E402

BACKENDS = {"torch": TorchBackend(), "mlx": MlxBackend()}
# the large Gemma 4s' full layers: wider heads, one key head whose keys are its values
K_EQ_V = {"global_head_dim": 16, "attention_k_eq_v": True, "num_global_key_value_heads": 1}
TYPES = ["sliding_attention", "full_attention"]


def k_eq_v_pair(root):
    """A tiny Gemma 4 target whose full layers are K_EQ_V's, and an assistant for it."""
    from transformers import (
        AutoModelForCausalLM,
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4TextConfig,
    )

    torch.manual_seed(3)
    sizes = {**_SIZES, **K_EQ_V}
    hf = AutoModelForCausalLM.from_config(Gemma4TextConfig(
        **sizes, num_hidden_layers=4, layer_types=TYPES * 2)).to(torch.float32)
    target = TorchModel(hf, tiny_tokenizer(), name="tiny-gemma4-k-eq-v", device="cpu")
    assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(**sizes, num_hidden_layers=2, layer_types=TYPES),
        backbone_hidden_size=32))
    with torch.no_grad():
        assistant.lm_head.weight.mul_(8.0)
    assistant.save_pretrained(root / "assistant-k-eq-v")
    return target, root / "assistant-k-eq-v"


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """The tiny Gemma 4 target on torch and the same weights on MLX."""
    target = gemma4_target()
    return {"torch": target, "mlx": mlx_twin(target, tmp_path_factory.mktemp("gemma4"))}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("assistant")
    return {"plain": assistant_folder(root), "ordered": assistant_folder(root, ordered=True)}


def first_chain(target, backend: str, folder, k: int = 5):
    """The first chain after PROMPT and the first draft's logits and projected state."""
    drafter = build_drafter("assistant", target, backend=BACKENDS[backend], head=str(folder))
    out = target.start().forward(PROMPT, n_logits=1, capture=drafter.capture_layers)
    first = int(out.argmax[-1])
    drafter.begin(PROMPT, StepFeed.prompt(PROMPT, out, first), SamplingParams(), None)
    chain = drafter.propose([*PROMPT, first], k).tokens
    xp, step = drafter.arrays, drafter.step
    with xp.context():
        inputs = xp.concat([step.embed(xp.asarray([first])), drafter._state], axis=-1)
        logits, state = step.run(inputs, len(PROMPT), drafter._kv)
    return chain, xp.to_numpy(xp.float32(logits)), xp.to_numpy(xp.float32(state))


@pytest.mark.parametrize("kind", ["plain", "ordered"])
def test_the_mlx_assistants_first_chain_and_logits_are_the_torch_assistants(twins, folders,
                                                                             kind):
    theirs = first_chain(twins["torch"], "torch", folders[kind])
    ours = first_chain(twins["mlx"], "mlx", folders[kind])
    assert ours[0] == theirs[0] and len(set(ours[0])) > 1
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours[2], theirs[2], rtol=1e-4, atol=1e-4)


def test_the_large_gemma_4s_key_heads_reach_mlx_lm_from_transformers_per_layer_config(
        tmp_path):
    target, folder = k_eq_v_pair(tmp_path)
    saved = target.hf.config.to_dict()
    assert "global_head_dim" not in saved  # transformers 5.25 writes per_layer_config only
    fixed = config_fixes(saved)
    assert fixed["global_head_dim"] == 16 and fixed["num_global_key_value_heads"] == 1
    theirs = first_chain(target, "torch", folder)
    ours = first_chain(mlx_twin(target, tmp_path / "target"), "mlx", folder)
    assert ours[0] == theirs[0]
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_the_mlx_assistant_gives_plain_decodings_tokens_past_the_window(
        twins, folders, k):
    target, params = twins["mlx"], SamplingParams(max_new_tokens=40)
    plain = list(SpecEngine(target).generate(PROMPT, params))[-1]
    drafter = RecordingDrafter(build_drafter("assistant", target, backend=BACKENDS["mlx"],
                                             head=str(folders["plain"])))
    done = list(SpecEngine(target).generate(PROMPT, params, drafter=drafter, k=k))[-1]
    assert done.error is None
    assert done.token_ids == plain.token_ids
    assert done.stats.drafted > 0 and done.stats.accepted > 0 and len(drafter.drafts) > 1


def test_auto_on_mlx_runs_an_assistant_given_as_the_draft(twins, folders, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path / "home"))
    args = SimpleNamespace(target=str(twins["mlx"].source), drafter="auto",
                           draft=str(folders["plain"]), k=4, backend="mlx", device="cpu",
                           dtype="float32", tree=False, no_history=True)
    loaded = load_engine(args)
    assert loaded.drafter_name == "assistant" and loaded.backend_name == "mlx"
    params = SamplingParams(max_new_tokens=24)
    done = list(loaded.engine.generate(PROMPT, params))[-1]
    plain = list(SpecEngine(twins["mlx"]).generate(PROMPT, params))[-1]
    assert done.token_ids == plain.token_ids and done.stats.drafted > 0


def test_the_mlx_assistant_is_refused_where_torch_refuses_it(folders, tmp_path):
    llama = MlxBackend().load(str(save_hf_folder(tiny_llama(1), tmp_path / "llama")),
                              device="cpu", dtype="float32")
    with pytest.raises(SpecdeckError, match="drafts for Gemma 4 targets only.*another drafter"):
        build_drafter("assistant", llama, backend=BACKENDS["mlx"], head=str(folders["plain"]))
    wider = mlx_twin(gemma4_target(), tmp_path / "gemma4")
    with pytest.raises(SpecdeckError, match="hidden size 64.*published with it"):
        build_drafter("assistant", wider, backend=BACKENDS["mlx"],
                      head=str(assistant_folder(tmp_path, hidden=64)))
