"""EAGLE heads on MLX: the same folders load, the MLX head computes the authors' logits (its
EAGLE-2 tree: test_eagle_golden.py) and the torch head's (held to the authors' code there), MLX
head chains and trees draft what torch's do and give plain decoding's output greedy and the
target's law sampled, and what MLX cannot run is refused by name. Runs on Linux through MLX's
CPU build (mlx[cpu])."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from app import drafters  # noqa: E402
from app.core.engine import SpecEngine  # noqa: E402
from app.core.feed import StepFeed  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from app.pair import Pair
from backends.mlx.backend import MlxBackend  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from tests.distributions import assert_follows, two_token_law  # noqa: E402
from tests.eagle_heads import LAYOUTS, write_head  # noqa: E402
from tests.marks import heavy  # noqa: E402
from tests.tiny import mlx_twin, tiny_llama  # noqa: E402

N_LAYERS = 8  # the default rule's layers 2, 4, 5 differ
FIXTURES = Path(__file__).parent / "fixtures" / "eagle"
VOCAB = 48
PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9, 30, 31]
START = 3000  # the position of the first head row in the logits comparison


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """One tiny target twice: torch (the reference) and MLX (the same weights)."""
    model = tiny_llama(seed=11, vocab=VOCAB, layers=N_LAYERS)
    return model, mlx_twin(model, tmp_path_factory.mktemp("mlx-eagle") / "deep-target")


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    folders = {layout: write_head(root / layout, layout, hidden=32, vocab=VOCAB,
                                  n_layers=N_LAYERS, seed=3) for layout in LAYOUTS}
    folders["variant"] = _norm_variant(heads_root=root, source=folders["speculators"])
    folders["llama3-rope"] = shutil.copytree(folders["midlayer"], root / "llama3-rope")
    config = json.loads((root / "llama3-rope" / "config.json").read_text())
    config.update(rope_theta=500000.0, max_position_embeddings=131072,  # Llama 3.1's heads
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
    (root / "llama3-rope" / "config.json").write_text(json.dumps(config))
    return folders


def _norm_variant(heads_root, source):
    """A speculators head with every optional norm: fc input and per-state norms, per-head
    q/k norms (Qwen3), post-norm feedback (EAGLE 3.1) and norm before the residual."""
    folder = heads_root / "variant"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(norm_before_fc=True, fc_norm=True, norm_output=True,
                  norm_before_residual=True)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(9)
    tensors["input_norm.weight"] = 1 + torch.randn(96, generator=gen) * 0.3
    for i in range(3):
        tensors[f"fc_norm.{i}.weight"] = 1 + torch.randn(32, generator=gen) * 0.3
    for name in ("q_norm", "k_norm"):
        tensors[f"layers.0.self_attn.{name}.weight"] = 1 + torch.randn(8, generator=gen) * 0.3
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def kind_of(layout: str) -> str:
    return "eagle" if layout == "eagle1" else "eagle3"


def build(target, folder, layout, tree=False):
    return drafters.build_drafter(kind_of(layout), target, backend=MlxBackend(),
                                  head=str(folder), tree=tree)


def plain(target, prompt, n):
    return list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=n)))[-1]


# ---------------------------------------------------------------- the head's numbers


@pytest.mark.parametrize("layout", [*LAYOUTS, "variant", "llama3-rope"])
def test_the_mlx_heads_logits_equal_the_torch_heads_for_two_draft_steps(twins, heads, layout):
    """From the same target states and embeddings: the rows over the context (draft step 1
    is the last) and draft step 2, fed step 1's token and feedback state; far into a context,
    where a scaled RoPE's low frequencies turn."""
    torch_target, mlx_target = twins
    kind = kind_of(layout)
    ours = MlxBackend().make_drafter(kind, mlx_target, head=str(heads[layout]))
    theirs = TorchBackend().make_drafter(kind, torch_target, head=str(heads[layout]))
    assert ours.capture_layers == theirs.capture_layers
    rng = np.random.default_rng(0)
    states = [rng.standard_normal((7, 32)).astype(np.float32) for _ in ours.capture_layers]
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42, 7]])
    embed = theirs.head.own_embedding() or torch_target.hf.get_input_embeddings()
    with torch.inference_mode():
        embeds = embed(tokens)
        want_h, past = theirs.head(embeds, theirs.head.project(
            [torch.from_numpy(s) for s in states])[None], torch.arange(START, START + 7)[None])
        want_1 = theirs.head.logits(want_h[0])
        token = theirs.head.to_target(want_1[-1].argmax(-1, keepdim=True))
        step_embed = embed(token[None])
        want_2 = theirs.head.logits(theirs.head(step_embed,
                                                theirs.head.feedback(want_h[0, -1])[None, None],
                                                torch.tensor([[START + 7]]), past)[0][0, -1])
    head = ours.head
    got_h, mlx_past = head(mx.array(embeds.numpy()),
                           head.project([mx.array(s) for s in states])[None],
                           mx.arange(START, START + 7)[None])
    got_1 = head.logits(got_h[0])
    assert head.to_target(mx.argmax(got_1[-1], keepdims=True)).tolist() == token.tolist()
    got_2 = head.logits(head(mx.array(step_embed.numpy()),
                             head.feedback(got_h[0, -1])[None, None],
                             mx.array([[START + 7]]), mlx_past)[0][0, -1])
    # at position 3000 torch's and MLX's fp32 RoPE angles round apart: logits of ~20 differ
    # by up to 3e-4; a head that ignored its llama3 scaling is 6e-2 off
    np.testing.assert_allclose(np.array(got_1), want_1.numpy(), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.array(got_2), want_2.numpy(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_mlx_heads_draft_steps_one_and_two_match_the_authors_code(layout):
    """tests/fixtures/eagle's golden logits, computed with the authors' code (see
    test_eagle_golden.py for the torch head on the same values)."""
    from backends.mlx.head_weights.eagle import load_eagle_head

    folder = FIXTURES / layout
    golden = mx.load(str(folder / "golden.safetensors"))
    kind = "eagle" if layout == "eagle1" else "eagle3"
    head, spec = load_eagle_head(folder, kind=kind, target_name="golden-target", hidden_size=32,
                                 vocab_size=VOCAB, n_layers=N_LAYERS)
    if kind == "eagle":
        head.use_target_head(lambda h: h @ golden["target_head"].T)
        chunks = [golden["feature"]]
    else:
        chunks = [golden["states"][:, i * 32:(i + 1) * 32] for i in range(3)]

    def embed(ids):
        own = head.own_embedding()
        return own(ids) if own is not None else golden["target_embed"][ids]

    ids = golden["ids"]
    h, past = head(embed(ids[None, 1:]), head.project(chunks)[None],
                   mx.arange(0, ids.size - 1)[None])
    logits1 = head.logits(h[0, -1])
    token = head.to_target(mx.argmax(logits1, keepdims=True))
    h2, _ = head(embed(token[None]), head.feedback(h[:, -1:]), mx.array([[ids.size - 1]]),
                 past)
    np.testing.assert_allclose(np.array(logits1), np.array(golden["logits1"]), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(np.array(head.logits(h2[0, -1])), np.array(golden["logits2"]),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout,tree", [("midlayer", False), ("speculators", False),
                                         ("eagle1", False), ("midlayer", True),
                                         ("eagle1", True)])
def test_mlx_and_torch_head_drafters_propose_the_same_drafts_step_by_step(twins, heads,
                                                                          layout, tree):
    """The whole drafter on twin float32 targets: every step's chain or tree (so the head's
    cache after each accepted path) is the torch drafter's, and so are the tokens."""
    torch_target, mlx_target = twins
    kind = kind_of(layout)
    proposals, outputs = {}, {}
    for name, target, backend in (("mlx", mlx_target, MlxBackend()),
                                  ("torch", torch_target, TorchBackend())):
        drafter = backend.make_drafter(kind, target, head=str(heads[layout]), tree=tree)
        proposals[name] = _recording(drafter)
        done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=24),
                                                drafter=drafter, k=4))[-1]
        assert done.error is None, done.error
        outputs[name] = done.token_ids
    assert proposals["mlx"] == proposals["torch"]
    assert outputs["mlx"] == outputs["torch"]
    assert len(proposals["mlx"]) > 4
    assert all((draft[1] is not None) == tree for draft in proposals["mlx"])


def _recording(drafter) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
    """Every draft drafter.propose returns, tokens and parents, in order (the drafter
    otherwise unchanged)."""
    seen: list[tuple[tuple[int, ...], tuple[int, ...] | None]] = []
    propose = drafter.propose

    def recorded(context, k):
        draft = propose(context, k)
        seen.append((draft.tokens, draft.parents))
        return draft

    drafter.propose = recorded
    return seen


# ---------------------------------------------------------------- lossless: greedy


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_an_mlx_head_chain_gives_exactly_plain_greedy_decoding(twins, heads, layout, k):
    _, target = twins
    truth = plain(target, PROMPT, 30).token_ids
    done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=30),
                                            drafter=build(target, heads[layout], layout),
                                            k=k))[-1]
    assert done.token_ids == truth
    assert done.stats.drafted > 0


@pytest.mark.parametrize("layout", ["midlayer", "eagle1"])
@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_an_mlx_eagle2_tree_gives_exactly_plain_greedy_decoding(twins, heads, layout, k):
    _, target = twins
    truth = plain(target, PROMPT, 30).token_ids
    drafter = build(target, heads[layout], layout, tree=True)
    done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=30),
                                            drafter=drafter, k=k))[-1]
    assert done.token_ids == truth
    assert done.stats.drafted > 0


@pytest.mark.parametrize("tree", [True, *heavy(False)])
def test_lookup_then_an_mlx_head_gives_exactly_plain_greedy_decoding_and_both_draft(
        twins, heads, tree):
    _, target = twins
    prompt = PROMPT * 3  # a repeated prompt: lookup finds matches, the head drafts the rest
    drafter = drafters.build_drafter("lookup+eagle3", target, backend=MlxBackend(),
                                     head=str(heads["midlayer"]), tree=tree)
    done = list(SpecEngine(target).generate(prompt, SamplingParams(max_new_tokens=30),
                                            drafter=drafter, k=4))[-1]
    assert done.token_ids == plain(target, prompt, 30).token_ids
    drafted = {m.name: m.drafted for m in done.stats.drafters}
    assert drafted.get("lookup", 0) > 0 and drafted.get("eagle3-tree" if tree else "eagle3") > 0


@pytest.mark.parametrize("layout", ["midlayer", "eagle1"])
def test_a_quantized_mlx_target_lends_its_embedding_and_output_layer_to_a_head(twins, heads,
                                                                               tmp_path, layout):
    """mlx-community folders are quantized: the head reads the target's quantized embedding
    (EAGLE-3 without its own) or output layer (EAGLE-1/2), and output stays plain decoding's."""
    from mlx_lm import convert

    torch_target, _ = twins
    source = tmp_path / "fp32"
    torch_target.hf.save_pretrained(source)
    torch_target.tokenizer.save_pretrained(source)
    convert(str(source), str(tmp_path / "q4"), quantize=True, q_group_size=32, q_bits=4)
    target = MlxBackend().load(str(tmp_path / "q4"), device="cpu")
    assert target.dtype == "4-bit/float32"
    drafter = build(target, heads[layout], layout)
    done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=20),
                                            drafter=drafter, k=3))[-1]
    assert done.token_ids == plain(target, PROMPT, 20).token_ids
    assert done.stats.drafted > 0


def test_the_mlx_heads_cache_after_accepted_steps_equals_reading_the_context_afresh(twins,
                                                                                   heads):
    """The head's KV cache follows the accepted path: after a run its next chain is that of
    a fresh drafter reading the whole committed context at once."""
    _, target = twins
    stepped = build(target, heads["eagle1"], "eagle1")
    done = list(SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=12),
                                            drafter=stepped, k=3))[-1]
    assert done.stats.accepted > 0  # accepted paths went into the head's cache
    context = PROMPT + list(done.token_ids)
    chains = []
    for drafter in (stepped, build(target, heads["eagle1"], "eagle1")):
        first = target.start().forward(context[:-1], capture=drafter.capture_layers)
        drafter.begin(context[:-1], StepFeed.prompt(context[:-1], first, context[-1]),
                      SamplingParams(), np.random.default_rng(0))
        chains.append(drafter.propose(context, 4).tokens)
    assert chains[0] == chains[1] and len(chains[0]) == 4


def test_one_mlx_head_drafter_serves_a_conversation_on_one_engine(twins, heads):
    _, target = twins
    engine = SpecEngine(target)
    drafter = build(target, heads["midlayer"], "midlayer")
    history = list(PROMPT)
    for turn in range(3):
        done = list(engine.generate(history, SamplingParams(max_new_tokens=10),
                                    drafter=drafter, k=3))[-1]
        assert done.token_ids == plain(target, history, 10).token_ids, turn
        assert done.stats.n_cached_prompt_tokens > 0 or turn == 0
        history = history + list(done.token_ids) + [7, 8, 9]


def test_generate_with_backend_mlx_and_a_head_folder_equals_plain_output(twins, heads,
                                                                        tmp_path, capsys):
    from app.cli import main

    torch_target, _ = twins
    torch_target.hf.save_pretrained(tmp_path / "target")
    torch_target.tokenizer.save_pretrained(tmp_path / "target")
    common = ["generate", "--backend", "mlx", "--device", "cpu", "--target",
              str(tmp_path / "target"), "--prompt", "w5 w9 w12 w5 w9", "--max-new-tokens", "16",
              "--json"]
    outputs = []
    for extra in (["--drafter", "none"],
                  ["--drafter", "auto", "--draft", str(heads["layers"])],
                  ["--drafter", "eagle", "--draft", str(heads["eagle1"]), "--k", "3"]):
        assert main([*common, *extra]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[1]["token_ids"] == outputs[2]["token_ids"] == outputs[0]["token_ids"]
    assert outputs[1]["drafter"] == "eagle3" and outputs[1]["drafted"] > 0


def test_bench_on_mlx_runs_a_head_as_a_chain_and_as_a_tree(twins, heads):
    from app.bench import run as bench
    from app.bench.settings import BenchSettings
    from tests.test_bench import word_prompts

    _, target = twins
    settings = BenchSettings(drafters=("eagle3", "eagle3:tree"), ks=(3,),
                                   max_new_tokens=8, head=str(heads["layers"]), warmup=0)
    pair = Pair.of(MlxBackend(), target, head=settings.head)
    runners, unavailable = bench.build_runners(pair, settings)
    assert [r.config.name for r in runners] == ["plain", "eagle3 k=3", "eagle3:tree k=3"]
    assert not unavailable
    report = bench.run_bench(Pair.of(MlxBackend(), target, head=settings.head), word_prompts(2),
                             settings)
    assert {c["name"] for c in report["configs"]} >= {"plain", "eagle3 k=3", "eagle3:tree k=3"}


# ---------------------------------------------------------------- lossless: sampled

SMALL_VOCAB = 8


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    model = mlx_twin(tiny_llama(seed=21, vocab=SMALL_VOCAB, layers=6),
                     tmp_path_factory.mktemp("mlx-small") / "small-target")
    model.eos_token_ids = frozenset()  # every generation runs its full length
    return model


def spread_head(folder, layout):
    """A head whose q is spread over several tokens (tests/eagle_heads.py's are near one-hot),
    so a q reported apart from the q sampled would skew the committed tokens."""
    write_head(folder, layout, hidden=32, vocab=SMALL_VOCAB, n_layers=6, seed=4, draft_vocab=6,
               scale=0.6 if layout == "midlayer" else 0.15)
    if layout == "midlayer":
        tensors = load_file(str(folder / "model.safetensors"))
        tensors["lm_head.weight"] = tensors["lm_head.weight"] / 16
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("layout", ["midlayer", "eagle1"])
def test_sampled_mlx_head_chains_report_the_q_they_sample_from(small_target, tmp_path,
                                                               layout):
    params = SamplingParams(temperature=1.0)
    prompt = [1, 2, 3, 4]
    drafter = build(small_target, spread_head(tmp_path / layout, layout), layout)
    drafter.min_confidence = 0.0  # chains of 2 whatever the head's confidence
    first = small_target.start().forward(prompt, capture=drafter.capture_layers)
    drafter.begin(prompt, StepFeed.prompt(prompt, first, 5), params, np.random.default_rng(0))
    counts = np.zeros(SMALL_VOCAB)
    for _ in range(400):
        draft = drafter.propose(prompt + [5], 2)
        assert draft.probs.shape == (2, SMALL_VOCAB)  # q over the target vocabulary
        np.testing.assert_allclose(draft.probs.sum(axis=1), 1.0, rtol=1e-5)
        counts[draft.tokens[0]] += 1
    assert (draft.probs[0] > 0.05).sum() >= 3  # spread: the χ² below has power
    assert_follows(counts, draft.probs[0] * 400)


@pytest.mark.heavy  # 900 sampled generations each
@pytest.mark.parametrize("layout,tree", [("midlayer", False), ("eagle1", False),
                                         ("midlayer", True)])
def test_sampled_speculation_with_an_mlx_head_draws_from_the_targets_distribution(
        small_target, tmp_path, layout, tree):
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    prompt = [1, 2, 3, 4]
    joint = two_token_law(small_target, prompt, params, SMALL_VOCAB)
    drafter = build(small_target, spread_head(tmp_path / layout, layout), layout, tree=tree)
    engine = SpecEngine(small_target)
    counts = np.zeros((SMALL_VOCAB, SMALL_VOCAB))
    n, accepted = 900, 0
    for seed in range(n):
        done = list(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=4,
                                                           seed=seed),
                                    drafter=drafter, k=2))[-1]
        counts[tuple(done.token_ids[1:3])] += 1
        accepted += done.stats.accepted
    assert_follows(counts, joint * n)
    assert accepted > n // 4  # the rejection rule was exercised on accepted drafts too


# ---------------------------------------------------------------- refusals


def test_a_head_for_another_target_is_refused_on_mlx_naming_both(heads, tmp_path):
    other = mlx_twin(tiny_llama(seed=5, vocab=VOCAB, layers=N_LAYERS, hidden=64),
                     tmp_path / "wide-target")
    with pytest.raises(SpecdeckError) as error:
        build(other, heads["speculators"], "speculators")
    message = str(error.value)
    assert "speculators" in message and "wide-target" in message
    assert "tiny-llama-test" in message and "hidden size 32 != 64" in message


def test_a_head_with_another_vocabulary_or_too_few_layers_is_refused_on_mlx(heads, tmp_path):
    for name, model in (("vocab-64", tiny_llama(seed=5, vocab=64, layers=N_LAYERS)),
                        ("three-layers", tiny_llama(seed=5, vocab=VOCAB, layers=3))):
        with pytest.raises(SpecdeckError, match=f"{name}.*Use a head trained for {name}"):
            build(mlx_twin(model, tmp_path / name), heads["midlayer"], "midlayer")


def test_an_eagle1_head_asked_for_as_eagle3_on_mlx_names_the_right_flag(twins, heads):
    _, target = twins
    with pytest.raises(SpecdeckError, match="--drafter eagle"):
        drafters.build_drafter("eagle3", target, backend=MlxBackend(), head=str(heads["eagle1"]))


def test_a_damaged_tensor_file_is_refused_by_name(twins, heads, tmp_path):
    _, target = twins
    folder = tmp_path / "damaged"
    shutil.copytree(heads["midlayer"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :64].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(SpecdeckError, match="damaged.*fc.weight"):
        build(target, folder, "midlayer")
