"""Gemma 4's assistant as a drafter: the chain transformers' own candidate generator drafts,
greedy output identical to plain past the sliding window, recognised from its folder, refused
where it cannot draft (a tiny random Gemma 4 target and assistant, fp32 on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4TextConfig,
)
from transformers.generation.candidate_generator import (  # noqa: E402
    SinglePositionMultiTokenCandidateGenerator,
)

from app.core.engine import SpecEngine  # noqa: E402
from app.core.feed import StepFeed  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from app.pair import folder_head_kind  # noqa: E402
from backends.torch.backend import TorchBackend, TorchModel  # noqa: E402
from tests.distributions import assert_first_two_follow  # noqa: E402
from tests.fakes import RecordingDrafter  # noqa: E402
from tests.tiny import VOCAB, tiny_llama, tiny_tokenizer  # noqa: E402

WINDOW = 8
PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9, 12, 4, 6, 2, 8, 10, 3, 14, 7, 11, 13]  # past 2 windows
_SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "global_head_dim": 8, "sliding_window": WINDOW, "hidden_size_per_layer_input": 0,
          "vocab_size_per_layer_input": 0, "max_position_embeddings": 256, "eos_token_id": 1,
          "bos_token_id": 0, "pad_token_id": 0}


def gemma4_target(seed: int = 1, vocab: int = VOCAB) -> TorchModel:
    """Four layers, sliding then full twice: layers 2 and 3 store the keys and values."""
    torch.manual_seed(seed)
    config = Gemma4TextConfig(**{**_SIZES, "vocab_size": vocab}, num_hidden_layers=4,
                              layer_types=["sliding_attention", "full_attention"] * 2)
    hf = AutoModelForCausalLM.from_config(config).to(torch.float32)
    return TorchModel(hf, tiny_tokenizer(vocab), name=f"tiny-gemma4-{seed}", device="cpu")


def assistant_folder(root, seed: int = 2, hidden: int = 32, vocab: int = VOCAB,
                     ordered: bool = False):
    """A two-layer assistant (every layer reading the target's keys and values), saved as
    safetensors; `hidden`: the target hidden size it was built for; `ordered`: its logits
    through ordered embeddings (4 centroids, the top 2 scored), a shuffled vocabulary."""
    torch.manual_seed(seed)
    text = Gemma4TextConfig(**{**_SIZES, "vocab_size": vocab}, num_hidden_layers=2,
                            layer_types=["sliding_attention", "full_attention"])
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=hidden,
                                   use_ordered_embeddings=ordered, num_centroids=4,
                                   centroid_intermediate_top_k=2)
    model = Gemma4AssistantForCausalLM(config)
    with torch.no_grad():  # sharper logits: drafts vary with their inputs
        model.lm_head.weight.mul_(8.0)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(vocab))
    folder = root / f"assistant-{seed}-{hidden}-{vocab}{'-ordered' * ordered}"
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target():
    return gemma4_target()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return assistant_folder(tmp_path_factory.mktemp("assistant"))


def assistant_of(target, folder):
    return build_drafter("assistant", target, backend=TorchBackend(), head=str(folder))


def test_the_first_chain_is_the_one_transformers_candidate_generator_drafts(target, folder):
    k = 5
    drafter = assistant_of(target, folder)
    out = target.start().forward(PROMPT, n_logits=1, capture=drafter.capture_layers)
    first = int(out.argmax[-1])
    drafter.begin(PROMPT, StepFeed.prompt(PROMPT, out, first), SamplingParams(), None)
    ours = drafter.propose([*PROMPT, first], k).tokens

    reference = Gemma4AssistantForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference.generation_config.num_assistant_tokens = k
    generator = SinglePositionMultiTokenCandidateGenerator(
        reference, target.hf.get_input_embeddings(), SimpleNamespace(max_length=256))
    with torch.inference_mode():
        outputs = target.hf(torch.tensor([PROMPT]), output_hidden_states=True,
                            return_shared_kv_states=True)
        ids, _ = generator.get_candidates(torch.tensor([[*PROMPT, first]]), {}, outputs,
                                          is_first_iteration=False, n_last_matches=0)
    assert first == int(outputs.logits[0, -1].argmax())
    assert ours == tuple(ids[0, len(PROMPT) + 1:].tolist())
    assert len(set(ours)) > 1  # a chain that depends on its inputs, not one repeated token


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_the_assistant_gives_plain_decodings_tokens_past_the_window(target, folder,
                                                                               k):
    params = SamplingParams(max_new_tokens=40)
    plain = list(SpecEngine(target).generate(PROMPT, params))[-1]
    drafter = RecordingDrafter(assistant_of(target, folder))
    done = list(SpecEngine(target).generate(PROMPT, params, drafter=drafter, k=k))[-1]
    assert done.error is None
    assert done.token_ids == plain.token_ids
    assert done.stats.drafted > 0 and len(drafter.drafts) > 1


@pytest.mark.heavy  # 500 sampled generations
def test_sampled_drafting_with_the_assistant_commits_the_targets_own_distribution(tmp_path):
    vocab = 4
    target = gemma4_target(seed=5, vocab=vocab)
    target.eos_token_ids = frozenset()
    drafter = assistant_of(target, assistant_folder(tmp_path, seed=6, vocab=vocab))
    assert_first_two_follow(target, drafter, [2, 3], vocab, n=500)


def test_an_assistant_folder_given_as_the_draft_is_recognised_as_the_assistant(folder,
                                                                               tmp_path):
    assert folder_head_kind(str(folder)) == "assistant"
    assert folder_head_kind(str(tmp_path)) is None


def test_an_assistant_for_another_target_is_refused_naming_the_fix(folder, tmp_path):
    with pytest.raises(SpecdeckError, match="drafts for Gemma 4 targets only.*another drafter"):
        assistant_of(tiny_llama(1), folder)
    wider = assistant_folder(tmp_path, hidden=64)
    with pytest.raises(SpecdeckError, match="hidden size 64.*published with it"):
        assistant_of(gemma4_target(), wider)


def test_every_backend_with_hidden_states_runs_the_assistant_but_llama_cpp():
    from app.drafters.kinds import check
    from backends import runs_of

    assert check("assistant", runs_of("mlx"), has_head=True) is None  # tests/test_mlx_assistant
    assert check("assistant", runs_of("llamacpp"), has_head=True) is not None
