"""On a CUDA GPU, speculative greedy output is plain decoding's: tiny fp32 models against the
naive oracle for every drafter kind, and SmolLM2 (float32) for plain, n-gram and self-draft.

Skipped without a GPU; scripts/gpu_check.sh sets SPECDECK_REQUIRE_CUDA=1, which turns a missing
GPU into a failure that says so. float32 with TF32 off: bf16 and fp16 make no bitwise promise
across row counts on GPUs, so a near-tie may legitimately break differently there.
SPECDECK_TEST_DEVICE=cpu runs the same checks on the CPU (how they were checked without a GPU).
"""

from __future__ import annotations

import json
import os

import pytest

from app import drafters
from app.cli import main
from app.core.engine import SpecEngine
from app.core.types import Done, SamplingParams
from backends.torch.backend import TorchBackend, TorchModel
from tests.test_engine import oracle  # naive greedy: a fresh session every step
from tests.tiny import tiny_llama

torch = pytest.importorskip("torch")

REQUIRED = os.environ.get("SPECDECK_REQUIRE_CUDA") == "1"
DEVICE = os.environ.get("SPECDECK_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not (torch.cuda.is_available() or REQUIRED),
                                reason="no CUDA GPU")
PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]
KS = [1, 3, 6]


@pytest.fixture(scope="module", autouse=True)
def cuda() -> None:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"SPECDECK_REQUIRE_CUDA=1 but torch {torch.__version__} sees no CUDA GPU "
                    f"(built for CUDA {torch.version.cuda}): install a CUDA build of torch, or "
                    "check nvidia-smi and CUDA_VISIBLE_DEVICES")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def on_cuda(seed: int) -> TorchModel:
    cpu = tiny_llama(seed=seed)
    return TorchModel(cpu.hf.to(DEVICE), cpu.tokenizer, name=cpu.name, device=DEVICE)


@pytest.fixture(scope="module")
def target() -> TorchModel:
    return on_cuda(1)


@pytest.fixture(scope="module")
def unrelated() -> TorchModel:
    return on_cuda(2)


def generate(engine: SpecEngine, n: int) -> Done:
    *_, done = engine.generate(PROMPT, SamplingParams(max_new_tokens=n))
    assert isinstance(done, Done) and done.error is None, done
    return done


def test_the_tiny_target_runs_on_the_gpu(target) -> None:
    assert next(target.hf.parameters()).device.type == DEVICE == target.device


@pytest.mark.parametrize("k", KS)
def test_target_as_its_own_draft_on_cuda_accepts_every_token_and_keeps_the_oracle(target, k):
    drafter = TorchBackend().make_drafter("draft", target, draft=target)
    done = generate(SpecEngine(target, drafter, k=k), 24)
    assert list(done.token_ids) == oracle(target, PROMPT, 24)
    assert done.stats.accepted == done.stats.drafted > 0


@pytest.mark.parametrize("k", KS)
def test_unrelated_draft_model_on_cuda_keeps_the_oracle_output(target, unrelated, k):
    drafter = TorchBackend().make_drafter("draft", target, draft=unrelated)
    done = generate(SpecEngine(target, drafter, k=k), 24)
    assert list(done.token_ids) == oracle(target, PROMPT, 24)
    assert done.stats.drafted > 0


@pytest.mark.parametrize("kind", ["ngram", "ngram-tree", "draft", "chain"])
def test_every_built_in_drafter_on_cuda_keeps_the_oracle_output(target, unrelated, kind):
    drafter = drafters.build_drafter(kind, target, backend=TorchBackend(), draft=unrelated)
    done = generate(SpecEngine(target, drafter, k=4), 30)
    assert list(done.token_ids) == oracle(target, PROMPT, 30)


def test_plain_decoding_on_cuda_is_the_oracle(target) -> None:
    done = generate(SpecEngine(target), 24)
    assert list(done.token_ids) == oracle(target, PROMPT, 24)
    assert done.stats.peak_memory_bytes > 0


@pytest.mark.slow
def test_smollm2_on_cuda_speculative_tokens_equal_plain(smollm2_gguf, capsys) -> None:
    def run(*args: str) -> dict:
        code = main(["generate", "--target", str(smollm2_gguf), "--chat", "--prompt",
                     "Write a Python function that returns the n-th Fibonacci number.",
                     "--max-new-tokens", "48", "--device", DEVICE, "--dtype", "float32",
                     "--json", *args])
        out = capsys.readouterr().out
        assert code == 0
        return json.loads(out)

    plain = run("--drafter", "none")
    ngram = run("--drafter", "ngram", "--k", "4")
    draft = run("--drafter", "draft", "--draft", str(smollm2_gguf), "--k", "4")
    assert plain["n_new_tokens"] > 10 and plain["text"].strip()
    assert ngram["token_ids"] == plain["token_ids"] == draft["token_ids"]
    assert draft["acceptance_rate"] == 1.0
