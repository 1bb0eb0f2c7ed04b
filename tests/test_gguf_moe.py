"""Qwen3.5-MoE (qwen35moe) and Qwen3-Next (qwen3next) GGUFs, written as llama.cpp's converter
writes them (tests/qwen35_gguf.py), run on their own blocks: the experts' 3-D tensors are
multiplied where they lie (one GgufLinear per expert's slice), the routers on the stored
router, Qwen3-Next's split q/k/v/z projection as one layer over both halves, its config built
from the file's metadata (transformers reads none); the logits are the source model's (F32) or
its dequantized twin's (Q8_0), greedy decoding gives the source's tokens, each row of an MoE
block gets the bits it gets alone, and speculation (lookup, with the recurrent rewind) keeps
plain decoding's tokens; llama.cpp, where installed, reads the same files to the same
logits."""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

torch = pytest.importorskip("torch")

from app.core.types import Done  # noqa: E402
from app.drafters.ngram import NgramDrafter  # noqa: E402
from backends.gguf_tensors import open_tensors  # noqa: E402
from backends.torch import gguf_model  # noqa: E402
from backends.torch.backend import TorchBackend, auto_cpu_dtype  # noqa: E402
from backends.torch.gguf_experts import GgufExperts, GgufRouter  # noqa: E402
from backends.torch.gguf_layers import GgufLinear, Part  # noqa: E402
from tests.qwen35_gguf import (  # noqa: E402
    ARCHITECTURES,
    F32,
    decoded,
    llama_cpp_run,
    load_files,
    logits,
    moe_twin,
    save_qwen35_gguf,
    tiny_moe,
)
from tests.test_engine import oracle  # noqa: E402

pytestmark = pytest.mark.skipif(gguf_model.unavailable_reason() is not None,
                                reason=f"no GGUF kernel here: {gguf_model.unavailable_reason()}")
Q8_0 = int(T.Q8_0)
FAMILIES = ["qwen3_5_moe_text", "qwen3_next"]
# seeds whose tiny models decode varied tokens from PROMPT, some of lookup's drafts rejected
SEEDS = {"qwen3_5_moe_text": 1, "qwen3_next": 4}
# repeats itself, so lookup drafts, and some drafts are rejected (the recurrent state rewinds)
PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9, 11, 13, 5, 9, 12]
NEW = 16


@pytest.fixture(scope="module", params=FAMILIES, ids=[ARCHITECTURES[f] for f in FAMILIES])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def source(family):
    model = tiny_moe(family, seed=SEEDS[family])
    model.eos_token_ids = frozenset()  # decodes NEW tokens, as the files' models do
    return model


@pytest.fixture(scope="module")
def files(source, family, tmp_path_factory):
    folder = tmp_path_factory.mktemp(ARCHITECTURES[family])
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


def moe_blocks(model) -> list[torch.nn.Module]:
    return [m for m in model.hf.modules() if isinstance(getattr(m, "experts", None), GgufExperts)]


CONFIG_FIELDS = ("model_type", "layer_types", "hidden_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "vocab_size", "tie_word_embeddings")


def test_a_moe_gguf_loads_with_its_config_and_every_expert_on_the_files_blocks(source, models):
    model = models[Q8_0]
    assert model.dtype == "gguf"
    # the file's config (transformers' reader for qwen35moe, specdeck's for qwen3next)
    ours, theirs = model.hf.config, source.hf.config
    assert {f: getattr(ours, f) for f in CONFIG_FIELDS} == {f: getattr(theirs, f)
                                                            for f in CONFIG_FIELDS}
    assert (ours.rope_parameters["partial_rotary_factor"]
            == theirs.rope_parameters["partial_rotary_factor"])
    blocks = moe_blocks(model)
    assert len(blocks) == source.hf.config.num_hidden_layers
    for block in blocks:
        assert isinstance(block.gate, GgufRouter)
        assert all(isinstance(layer, GgufLinear) for layer in [*block.experts.gate_up,
                                                               *block.experts.down])
    # nothing the size of an expert was read into a float parameter: the blocks are counted
    # where they lie, each expert tensor once
    assert not any(".experts." in name for name, _ in model.hf.named_parameters())
    tensors = model.hf.gguf_tensors
    experts = sum(i.nbytes for n, i in tensors.infos.items() if "_exps." in n)
    assert experts > 0 and gguf_model.stored_bytes(model.hf) >= experts


def test_a_moe_gguf_on_blocks_matches_its_source_logits(source, models):
    ours, theirs = logits(models[F32], PROMPT), logits(source, PROMPT)
    # float32 throughout: only the summation order, (w + 1) - 1 and log(exp(A_log)) round (a
    # few 1e-7 on logits near 3); an expert read from the wrong slice moves them by tenths
    assert float((ours - theirs).abs().max()) < 1e-5


def test_experts_stored_as_one_gate_up_tensor_compute_the_same(source, models, tmp_path):
    """A file whose experts' gate and up are one ffn_gate_up_exps tensor (gate rows first
    in each expert, as transformers holds them) gives the split file's logits exactly."""
    path = save_qwen35_gguf(source, tmp_path / "fused.gguf", F32, fused_experts=True)
    assert any(name.endswith("ffn_gate_up_exps.weight")
               for name in open_tensors(path).infos)
    fused = TorchBackend().load(str(path), device="cpu", dtype="gguf")
    assert torch.equal(logits(fused, PROMPT), logits(models[F32], PROMPT))


def test_q8_0_experts_compute_what_the_dequantized_twin_computes(source, models):
    twin = moe_twin(source, Q8_0)
    ours, theirs = logits(models[Q8_0], PROMPT), logits(twin, PROMPT)
    # the only difference: activations quantized to 8 bits per block of 32, as llama.cpp does,
    # which moves a logit by a few hundredths: the best token is the twin's wherever it leads
    # by more than that (random tiny models have near ties: 0.003 at one of tiny Next's rows)
    assert float((ours - theirs).norm() / theirs.norm()) < 0.02
    top = theirs.topk(2, dim=-1).values
    clear = top[:, 0] - top[:, 1] > 0.1
    assert clear.sum() >= len(PROMPT) // 2
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


def test_greedy_decoding_on_a_moe_gguf_gives_the_source_models_tokens(source, models, plain):
    assert plain(F32) == list(generate(source).token_ids)
    assert plain(Q8_0) == oracle(models[Q8_0], PROMPT, NEW)  # and plain is the naive oracle


def test_each_row_of_a_moe_block_gets_the_bits_it_gets_alone(models):
    """The row-invariance promise through routing: nine rows together, each row's output is
    bitwise its one-row output (a router on torch's float32 matmul breaks this)."""
    hidden = int(models[Q8_0].hf.config.hidden_size)
    rows = torch.randn((1, 9, hidden), generator=torch.Generator().manual_seed(3))
    for kind in (F32, Q8_0):
        block = moe_blocks(models[kind])[0]
        with torch.no_grad():
            together = block(rows)[0]
            alone = [block(rows[:, i:i + 1])[0, 0] for i in range(rows.shape[1])]
        assert all(torch.equal(together[i], alone[i]) for i in range(rows.shape[1]))


@pytest.mark.parametrize("kind, k", [(Q8_0, 3), (F32, 3)])
def test_lookup_on_a_moe_gguf_keeps_the_plain_output(models, plain, kind, k):
    done = generate(models[kind], NgramDrafter(), k=k)
    assert list(done.token_ids) == plain(kind)
    assert done.stats.drafted > done.stats.accepted  # some drafts rejected: the state rewound


def test_llama_cpp_reads_the_same_moe_model_from_the_file(files, models, plain):
    """The convention itself: llama.cpp's own loader and graph, on the F32 file, give the
    logits and greedy tokens specdeck's reading gives (in a child, as a ggml assert aborts)."""
    pytest.importorskip("llama_cpp")
    theirs = llama_cpp_run(files[F32], PROMPT, NEW)
    ours = logits(models[F32], PROMPT).numpy()
    # llama.cpp keeps its KV cache in F16: a few 1e-4 on logits near 3
    assert np.abs(np.array(theirs["logits"]) - ours).max() < 5e-3
    assert plain(F32) == theirs["tokens"]


_QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 1
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
"""


@pytest.fixture(scope="module")
def q4_k_m(family, tmp_path_factory):
    """A 256-wide tiny model (K-quants' blocks) quantized to Q4_K_M by llama.cpp itself, so
    its experts are llama.cpp's own Q4_K blocks (the gguf package quantizes no K-quant)."""
    pytest.importorskip("llama_cpp")
    folder = tmp_path_factory.mktemp(f"{ARCHITECTURES[family]}-q4_k_m")
    wide = tiny_moe(family, seed=SEEDS[family], width=256)
    f32 = save_qwen35_gguf(wide, folder / "f32.gguf")
    path = folder / "Q4_K_M.gguf"
    run = subprocess.run([sys.executable, "-c", _QUANTIZE, str(f32), str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return path, wide


def test_each_q4_k_expert_multiplies_its_own_slice_of_llama_cpps_blocks(q4_k_m):
    """Every expert's layer (on kquant's tiles where this CPU has them) computes what its
    slice of the 3-D tensor holds: x times the slice's dequantized rows, within 8-bit
    activations' 1% (a neighbouring expert's slice would be off by 100%)."""
    model = TorchBackend().load(str(q4_k_m[0]), device="cpu", dtype="gguf")
    x = torch.randn((5, 256), generator=torch.Generator().manual_seed(0))
    layers = [layer for block in moe_blocks(model)
              for layer in [*block.experts.gate_up, *block.experts.down]]
    assert {part.ggml_type for layer in layers for part in layer.parts} & {int(T.Q4_K)}
    for layer in layers:
        weights = torch.cat([part.float_rows(0, part.out_features) for part in layer.parts])
        expected = x[:, :layer.in_features] @ weights.T
        ours = layer(x[:, :layer.in_features])
        assert float((ours - expected).norm() / expected.norm()) < 0.01
        if any(part.packed is not None for part in layer.parts):  # and ggml agrees on it
            ggml = GgufLinear([Part(part.data, part._info) for part in layer.parts])
            assert float((ours - ggml(x[:, :layer.in_features])).norm() / ours.norm()) < 0.01


def test_llama_cpp_computes_the_same_logits_from_a_q4_k_m_moe_file(q4_k_m):
    """llama.cpp's graph on its own Q4_K_M file and specdeck's reading of it: each matmul
    differs only by its activations' rounding (llama.cpp's Q8_K, kquant's own 8 bits: 0.5% a
    layer, above), which a random tiny model amplifies, as it amplifies the Q4 weights' own
    error (each reading lies 30-60% from the float32 source). Measured: specdeck's logits lie
    a quarter to a third of that from llama.cpp's; a layout or slice read wrong lies as far
    from both as from the source, or farther."""
    path, source = q4_k_m
    model = TorchBackend().load(str(path), device="cpu", dtype="gguf")
    theirs = torch.tensor(llama_cpp_run(path, PROMPT, 1)["logits"])
    ours = logits(model, PROMPT)
    quantization = float((theirs - logits(source, PROMPT)).norm())
    assert float((ours - theirs).norm()) < 0.5 * quantization


def test_auto_picks_a_moe_files_own_blocks(files):
    assert auto_cpu_dtype(files[Q8_0])[0] == "gguf"
