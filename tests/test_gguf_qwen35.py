"""A Qwen3.5 GGUF (qwen35), written as llama.cpp's converter writes one (tests/qwen35_gguf.py),
runs on its own blocks: its config and tokenizer come from the file, what llama.cpp stored
transformed is undone, the logits are the source model's (F32 matrices) or its dequantized
twin's (Q8_0), llama.cpp computes the same from the same file, and speculation (lookup, with
the recurrent rewind) keeps plain decoding's tokens. (qwen35moe and qwen3next, with their
experts: tests/test_gguf_moe.py.)"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

torch = pytest.importorskip("torch")

from app.cli import main  # noqa: E402
from app.core.types import Done  # noqa: E402
from app.drafters.ngram import NgramDrafter  # noqa: E402
from backends.torch import gguf_model  # noqa: E402
from backends.torch.backend import auto_cpu_dtype  # noqa: E402
from backends.torch.gguf_layers import GgufLinear  # noqa: E402
from tests.qwen35_gguf import (  # noqa: E402
    F32,
    decoded,
    llama_cpp_run,
    load_files,
    logits,
    save_qwen35_gguf,
    tiny_qwen35,
    vocabulary,
)
from tests.test_engine import oracle  # noqa: E402
from tests.tiny import dequantized_twin  # noqa: E402

pytestmark = pytest.mark.skipif(gguf_model.unavailable_reason() is not None,
                                reason=f"no GGUF kernel here: {gguf_model.unavailable_reason()}")
Q8_0 = int(T.Q8_0)
# repeats itself, so lookup drafts, and some drafts are rejected (the recurrent state rewinds)
PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9, 11, 13, 5, 9, 12]
NEW = 16


@pytest.fixture(scope="module")
def source():
    return tiny_qwen35(seed=1)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35")
    return {kind: save_qwen35_gguf(source, folder / f"{T(kind).name}.gguf", kind)
            for kind in (F32, Q8_0)}


@pytest.fixture(scope="module")
def models(files):
    return load_files(files)


@pytest.fixture(scope="module")
def plain(models):
    """Plain greedy tokens of each file's model, decoded once when first asked."""
    return functools.cache(lambda kind: list(generate(models[kind]).token_ids))


def generate(model, drafter=None, k: int = 0) -> Done:
    return decoded(model, PROMPT, NEW, drafter, k)


def test_a_qwen35_gguf_loads_on_its_own_blocks_with_the_files_config_and_tokenizer(source,
                                                                                   models):
    model = models[Q8_0]
    assert model.dtype == "gguf"
    config = model.hf.config
    assert config.model_type == "qwen3_5_text"
    assert config.layer_types == source.hf.config.layer_types
    linears = [m for m in model.hf.modules() if isinstance(m, GgufLinear)]
    # per linear-attention layer qkv, z, b, a, out and gate/up fused, down; the full
    # attention layer's q/k/v fused, o, gate/up, down; the output layer
    assert len(linears) == 3 * 7 + 4 + 1
    tokens = vocabulary()
    assert model.tokenizer("abcd")["input_ids"] == [tokens.index("ab"), tokens.index("cd")]
    assert model.tokenizer.eos_token == tokens[1]


def test_f32_matrices_compute_the_source_models_logits(source, models):
    ours, theirs = logits(models[F32], PROMPT), logits(source, PROMPT)
    # float32 throughout: only the summation order, (w + 1) - 1 and log(exp(A_log)) round
    # in the last bits (about 1e-7 of logits near 3); a transform left undone moves them by
    # tenths
    assert float((ours - theirs).abs().max()) < 1e-4


def test_q8_0_matrices_compute_what_the_dequantized_twin_computes(source, models):
    twin = dequantized_twin(source, Q8_0)
    ours, theirs = logits(models[Q8_0], PROMPT), logits(twin, PROMPT)
    # the only difference: activations quantized to 8 bits per block of 32, as llama.cpp does
    assert float((ours - theirs).norm() / theirs.norm()) < 0.02
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_plain_decoding_on_a_qwen35_gguf_is_the_oracle(models, plain):
    assert plain(Q8_0) == oracle(models[Q8_0], PROMPT, NEW)


@pytest.mark.parametrize("kind, k", [(Q8_0, 1), (Q8_0, 3), (F32, 3)])
def test_lookup_on_a_qwen35_gguf_keeps_the_plain_output(models, plain, kind, k):
    done = generate(models[kind], NgramDrafter(), k=k)
    assert list(done.token_ids) == plain(kind)
    assert done.stats.drafted > done.stats.accepted  # some drafts rejected: the state rewound


def test_generate_with_drafter_ngram_on_a_qwen35_gguf_is_token_identical(files, capsys):
    common = ["--target", str(files[Q8_0]), "--prompt", "abcdefabcdefabcdef",
              "--max-new-tokens", "10", "--json"]
    runs = {}
    for drafter in ("none", "ngram"):
        assert main(["generate", *common, "--drafter", drafter, "--k", "3"]) == 0
        runs[drafter] = json.loads(capsys.readouterr().out)
    assert runs["ngram"]["token_ids"] == runs["none"]["token_ids"]
    assert runs["ngram"]["dtype"] == "gguf" and runs["ngram"]["drafted"] > 0


def test_llama_cpp_reads_the_same_model_from_the_file(files, models, plain):
    """The convention itself: llama.cpp's own loader and graph, on the F32 file, give the
    logits and greedy tokens specdeck's reading gives (in a child, as a ggml assert aborts)."""
    pytest.importorskip("llama_cpp")
    theirs = llama_cpp_run(files[F32], PROMPT, NEW)
    ours = logits(models[F32], PROMPT).numpy()
    # llama.cpp keeps its KV cache in F16: a few 1e-4 on logits near 3
    assert np.abs(np.array(theirs["logits"]) - ours).max() < 5e-3
    assert plain(F32) == theirs["tokens"]


def test_auto_picks_a_qwen35_files_own_blocks(files):
    assert auto_cpu_dtype(files[Q8_0])[0] == "gguf"
