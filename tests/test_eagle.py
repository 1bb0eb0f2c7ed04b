"""EAGLE heads: every published layout loads, a wrong head is refused naming both models, and
speculative output with a head (chain or EAGLE-2 tree, greedy or sampled) is plain decoding's."""

from __future__ import annotations

import numpy as np
import pytest

from app import drafters
from app.core.engine import SpecEngine
from app.core.feed import StepFeed
from app.core.types import SamplingParams, SpecdeckError
from app.pair import Pair
from backends.torch.backend import TorchBackend
from tests.distributions import assert_follows, two_token_law
from tests.eagle_heads import LAYOUTS, write_head
from tests.marks import heavy
from tests.tiny import tiny_llama

torch = pytest.importorskip("torch")

N_LAYERS = 8  # the default rule's layers 2, 4, 5 differ
VOCAB = 48
PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9, 30, 31]


@pytest.fixture(scope="module")
def deep_target():
    return tiny_llama(seed=11, vocab=VOCAB, layers=N_LAYERS)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {layout: write_head(root / layout, layout, hidden=32, vocab=VOCAB,
                               n_layers=N_LAYERS, seed=3) for layout in LAYOUTS}


def kind_of(layout: str) -> str:
    return "eagle" if layout == "eagle1" else "eagle3"


def build(target, folder, layout, tree=False):
    return drafters.build_drafter(kind_of(layout), target, backend=TorchBackend(),
                                  head=str(folder), tree=tree)


def plain(target, prompt, n, params=None):
    params = params or SamplingParams(max_new_tokens=n)
    return list(SpecEngine(target).generate(prompt, params))[-1].token_ids


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_reads_the_layers_its_convention_names(deep_target, heads, layout):
    drafter = build(deep_target, heads[layout], layout)
    # hook L = output of layer L = hidden state L + 1 (capture-before)
    expected = {"midlayer": (1, 3, 4),  # default [2, N//2, N-3]
                "layers": (1, 3, 4),  # SpecForge [1, 3, 4] output-of-layer = [2, 4, 5]
                "speculators": (0, 2, 5),  # boundary ids [1, 3, 6]
                "eagle1": (7,)}[layout]  # the final state (normed by the drafter)
    assert drafter.capture_layers == expected


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_a_head_chain_gives_exactly_plain_greedy_decoding(deep_target, heads, layout, k):
    truth = plain(deep_target, PROMPT, 30)
    engine = SpecEngine(deep_target)
    drafter = build(deep_target, heads[layout], layout)
    drafter.min_confidence = 0.0  # chains of exactly k, however unsure the random head is
    done = list(engine.generate(PROMPT, SamplingParams(max_new_tokens=30),
                                drafter=drafter, k=k))[-1]
    assert done.token_ids == truth
    assert done.stats.drafted > 0


@pytest.mark.parametrize("cut", [0.0, 0.05, 0.3, 1.0])
def test_a_chain_stops_where_the_heads_own_confidence_in_it_falls_below_the_cut(
        deep_target, heads, cut):
    drafter = build(deep_target, heads["midlayer"], "midlayer")
    drafter.min_confidence = cut
    chosen: list[float] = []
    choose = drafter._choose
    drafter._choose = lambda logits: (lambda c: chosen.append(c.p) or c)(choose(logits))
    first = SpecEngine(deep_target).session.forward(PROMPT[:-1], n_logits=1,
                                                    capture=drafter.capture_layers)
    drafter.begin(PROMPT[:-1], StepFeed.prompt(PROMPT[:-1], first, PROMPT[-1]), SamplingParams(),
                  np.random.default_rng(0))
    tokens = drafter.propose(PROMPT, 7).tokens
    reach = np.cumprod(chosen)
    assert len(tokens) == len(chosen)
    assert all(r >= cut for r in reach[:-1]) and (len(tokens) == 7 or reach[-1] < cut)
    if cut == 0.0:
        assert len(tokens) == 7  # no cut: the head's probabilities are not even computed
    else:
        assert 0.0 < reach[0] < 1.0
    if cut == 1.0:
        assert len(tokens) == 1


@pytest.mark.parametrize("k", [2, *heavy(7)])
def test_a_chain_cut_short_by_the_heads_confidence_still_gives_plain_greedy_decoding(
        deep_target, heads, k):
    drafter = build(deep_target, heads["midlayer"], "midlayer")
    drafter.min_confidence = 0.05
    done = list(SpecEngine(deep_target).generate(PROMPT, SamplingParams(max_new_tokens=30),
                                                 drafter=drafter, k=k))[-1]
    assert done.token_ids == plain(deep_target, PROMPT, 30)
    assert done.stats.drafted > 0


@pytest.mark.parametrize("layout", ["midlayer", "eagle1"])
@pytest.mark.parametrize("k", [*heavy(1, 2), 4, *heavy(7)])
def test_an_eagle2_tree_gives_exactly_plain_greedy_decoding(deep_target, heads, layout, k):
    truth = plain(deep_target, PROMPT, 30)
    drafter = build(deep_target, heads[layout], layout, tree=True)
    done = list(SpecEngine(deep_target).generate(PROMPT, SamplingParams(max_new_tokens=30),
                                                 drafter=drafter, k=k))[-1]
    assert done.token_ids == truth
    assert done.stats.drafted > 0


def test_a_tree_keeps_its_node_budget_and_depth_k(deep_target, heads):
    drafter = build(deep_target, heads["midlayer"], "midlayer", tree=True)
    engine = SpecEngine(deep_target)
    first = engine.session.forward(PROMPT, n_logits=1, capture=drafter.capture_layers)
    drafter.begin(PROMPT, StepFeed.prompt(PROMPT, first, first.argmax[-1]), SamplingParams(),
                  np.random.default_rng(0))
    draft = drafter.propose(PROMPT + [first.argmax[-1]], 4)
    assert draft.is_tree and len(draft.tokens) == drafter.max_nodes
    assert max(draft.depths()) <= 4
    assert all(p < i for i, p in enumerate(draft.parents))


def test_the_heads_cache_after_accepted_steps_equals_reading_the_context_afresh(
        deep_target, heads):
    """The head's KV cache follows the accepted path: its next draft after several steps is the
    draft of a fresh drafter that reads the whole committed context at once."""
    params = SamplingParams(max_new_tokens=12)
    stepped = build(deep_target, heads["layers"], "layers")
    done = list(SpecEngine(deep_target).generate(PROMPT, params, drafter=stepped, k=3))[-1]
    context = PROMPT + list(done.token_ids)
    # the stepped drafter's state after the run: continue it by one more propose
    fresh = build(deep_target, heads["layers"], "layers")
    engine = SpecEngine(deep_target)
    first = engine.session.forward(context[:-1], n_logits=1, capture=fresh.capture_layers)
    fresh.begin(context[:-1], StepFeed.prompt(context[:-1], first, context[-1]),
                SamplingParams(), np.random.default_rng(0))
    stepped_engine = SpecEngine(deep_target)
    again = stepped_engine.session.forward(context[:-1], n_logits=1,
                                           capture=stepped.capture_layers)
    stepped.begin(context[:-1], StepFeed.prompt(context[:-1], again, context[-1]),
                  SamplingParams(), np.random.default_rng(0))
    assert stepped.propose(context, 4).tokens == fresh.propose(context, 4).tokens


def test_a_head_for_another_target_is_refused_naming_both(heads):
    other = tiny_llama(seed=5, vocab=VOCAB, layers=N_LAYERS, hidden=64)
    with pytest.raises(SpecdeckError) as error:
        build(other, heads["speculators"], "speculators")
    assert "speculators" in str(error.value) and other.name in str(error.value)
    assert "tiny-llama-test" in str(error.value)  # the verifier the head names


def test_a_head_with_another_vocabulary_or_too_few_layers_is_refused(heads):
    for model in (tiny_llama(seed=5, vocab=64, layers=N_LAYERS),
                  tiny_llama(seed=5, vocab=VOCAB, layers=3)):
        with pytest.raises(SpecdeckError, match=model.name):
            build(model, heads["midlayer"], "midlayer")


def test_an_eagle1_head_asked_for_as_eagle3_names_the_right_flag(deep_target, heads):
    with pytest.raises(SpecdeckError, match="--drafter eagle"):
        drafters.build_drafter("eagle3", deep_target, backend=TorchBackend(),
                               head=str(heads["eagle1"]))


def test_a_head_kind_without_its_folder_names_the_flag(deep_target):
    with pytest.raises(SpecdeckError, match="--draft HEAD_DIR"):
        drafters.build_drafter("eagle3", deep_target, backend=TorchBackend())


# ---------------------------------------------------------------- sampled: the target's law

SMALL_VOCAB = 8


@pytest.fixture(scope="module")
def small_target():
    model = tiny_llama(seed=21, vocab=SMALL_VOCAB, layers=6)
    model.eos_token_ids = frozenset()  # every generation runs its full length
    return model


@pytest.mark.heavy  # 900 sampled generations each
@pytest.mark.parametrize("layout,tree", [("midlayer", False), ("eagle1", False),
                                         ("speculators", True)])
def test_sampled_speculation_with_a_head_draws_from_the_targets_distribution(
        small_target, tmp_path, layout, tree):
    folder = write_head(tmp_path / layout, layout, hidden=32, vocab=SMALL_VOCAB, n_layers=6,
                        seed=4, draft_vocab=6, scale=0.6)
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    prompt = [1, 2, 3, 4]
    joint = two_token_law(small_target, prompt, params, SMALL_VOCAB)
    drafter = build(small_target, folder, layout, tree=tree)
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
    assert accepted > 0  # the rejection rule was exercised on accepted drafts too


# ---------------------------------------------------------------- surfaces


def test_generate_with_a_head_folder_and_tree_equals_plain_output(deep_target, heads, tmp_path,
                                                                  capsys):
    import json

    from app.cli import main

    deep_target.hf.save_pretrained(tmp_path / "target")
    deep_target.tokenizer.save_pretrained(tmp_path / "target")
    common = ["generate", "--target", str(tmp_path / "target"), "--prompt", "w5 w9 w12 w5 w9",
              "--max-new-tokens", "16", "--json", "--dtype", "float32"]
    outputs = []
    for extra in (["--drafter", "none"],
                  ["--drafter", "eagle3", "--draft", str(heads["midlayer"]), "--tree"],
                  ["--drafter", "eagle", "--draft", str(heads["eagle1"]), "--k", "3"]):
        assert main([*common, *extra]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[1]["token_ids"] == outputs[2]["token_ids"] == outputs[0]["token_ids"]
    assert outputs[1]["drafter"] == "eagle3" and outputs[1]["drafted"] > 0


@pytest.mark.parametrize("k", [*heavy(1), 4, *heavy(7)])
def test_lookup_then_a_head_gives_exactly_plain_greedy_decoding_and_both_draft(
        deep_target, heads, k):
    prompt = PROMPT * 3  # a repeated prompt: lookup finds matches, the head drafts the rest
    truth = plain(deep_target, prompt, 40)
    drafter = drafters.build_drafter("lookup+eagle3", deep_target, backend=TorchBackend(),
                                     head=str(heads["midlayer"]))
    done = list(SpecEngine(deep_target).generate(prompt, SamplingParams(max_new_tokens=40),
                                                 drafter=drafter, k=k))[-1]
    assert done.token_ids == truth
    drafted = {m.name: m.drafted for m in done.stats.drafters}
    assert drafted.get("lookup", 0) > 0 and drafted.get("eagle3", 0) > 0


def test_bench_runs_a_head_as_a_chain_and_as_a_tree(deep_target, heads):
    from app.bench import run as bench
    from app.bench.settings import BenchSettings
    from tests.test_bench import word_prompts

    settings = BenchSettings(drafters=("eagle3", "eagle3:tree"), ks=(3,),
                                   max_new_tokens=8, head=str(heads["speculators"]), warmup=0)
    pair = Pair.of(TorchBackend(), deep_target, head=settings.head)
    report = bench.run_bench(pair, word_prompts(2), settings)
    names = {c["name"] for c in report["configs"]}
    assert {"eagle3 k=3", "eagle3:tree k=3"} <= names  # both built (else left out)


@pytest.mark.parametrize("ids", [None, (1, 4, 6), (3, 5, 7)])
def test_a_head_saved_in_the_authors_layout_reloads_reading_the_same_layers(tmp_path, ids):
    from backends.heads.eagle_format import new_eagle3_spec
    from backends.torch.head_weights.eagle import Eagle3Head, load_eagle_head, save_eagle3

    spec = new_eagle3_spec("fresh", target_hidden_size=32, vocab_size=VOCAB, draft_vocab_size=16,
                           num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                           layer_ids=ids)
    head = Eagle3Head(spec)
    save_eagle3(head, tmp_path / "fresh")
    loaded, again = load_eagle_head(tmp_path / "fresh", kind="eagle3", target_name="t",
                                    hidden_size=32, vocab_size=VOCAB, n_layers=N_LAYERS)
    assert again.hs_ids(N_LAYERS) == spec.hs_ids(N_LAYERS)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_auto_with_a_head_folder_runs_the_head_and_a_draft_kind_refuses_it(deep_target, heads,
                                                                           tmp_path, capsys):
    import json

    from app.cli import main

    deep_target.hf.save_pretrained(tmp_path / "target")
    deep_target.tokenizer.save_pretrained(tmp_path / "target")
    common = ["generate", "--target", str(tmp_path / "target"), "--prompt", "w5 w9 w12",
              "--max-new-tokens", "6", "--json", "--dtype", "float32",
              "--draft", str(heads["layers"])]
    assert main([*common, "--drafter", "auto"]) == 0
    assert json.loads(capsys.readouterr().out)["drafter"] == "eagle3"
    assert main([*common, "--drafter", "draft"]) != 0
    assert ("is an EAGLE-3 head on the target's hidden states, not a draft model: use "
            "--drafter eagle3") in capsys.readouterr().err


def test_norm_variants_and_qk_norms_load_and_apply(deep_target, heads, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from backends.torch.head_weights.eagle import RMSNorm

    folder = tmp_path / "variant"
    shutil.copytree(heads["speculators"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(norm_before_fc=True, fc_norm=True)
    config["transformer_layer_config"]["model_type"] = "qwen3"
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(9)
    tensors["input_norm.weight"] = 1 + torch.randn(96, generator=gen) * 0.3
    for i in range(3):
        tensors[f"fc_norm.{i}.weight"] = 1 + torch.randn(32, generator=gen) * 0.3
    for name in ("q_norm", "k_norm"):
        tensors[f"layers.0.self_attn.{name}.weight"] = 1 + torch.randn(8, generator=gen) * 0.3
    save_file(tensors, str(folder / "model.safetensors"))
    drafter = build(deep_target, folder, "speculators")
    head, spec = drafter.head, drafter.spec
    assert spec.norm_before_fc and spec.fc_norm and spec.qk_norm
    states = [torch.randn(5, 32, generator=gen) for _ in range(3)]
    chunks = []
    for i, s in enumerate(states):
        norm = RMSNorm(32, spec.rms_norm_eps)
        norm.weight.data = tensors[f"fc_norm.{i}.weight"]
        chunks.append(norm(s))
    outer = RMSNorm(96, spec.rms_norm_eps)
    outer.weight.data = tensors["input_norm.weight"]
    expected = torch.nn.functional.linear(outer(torch.cat(chunks, -1)), tensors["fc.weight"])
    torch.testing.assert_close(head.project(states), expected)
    truth = plain(deep_target, PROMPT, 20)
    done = list(SpecEngine(deep_target).generate(PROMPT, SamplingParams(max_new_tokens=20),
                                                 drafter=drafter, k="auto"))[-1]
    assert done.token_ids == truth


def test_one_head_drafter_serves_a_conversation_on_one_engine(deep_target, heads):
    """Calls share the engine's cached prefix (the prefill then covers only new tokens) and the
    head's cache keeps what still matches: output stays plain decoding's, turn after turn."""
    engine = SpecEngine(deep_target)
    drafter = build(deep_target, heads["midlayer"], "midlayer", tree=True)
    history = list(PROMPT)
    for turn in range(3):
        params = SamplingParams(max_new_tokens=10)
        done = list(engine.generate(history, params, drafter=drafter, k=3))[-1]
        assert done.token_ids == plain(deep_target, history, 10), turn
        assert done.stats.n_cached_prompt_tokens > 0 or turn == 0
        history = history + list(done.token_ids) + [7, 8, 9]


def test_an_eagle3_variant_without_aux_states_is_refused_by_name(deep_target, heads, tmp_path):
    import json
    import shutil

    folder = tmp_path / "no-aux"
    shutil.copytree(heads["layers"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["eagle_config"]["use_aux_hidden_state"] = False
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdeckError, match="use_aux_hidden_state"):
        build(deep_target, folder, "layers")


def test_the_ui_offers_a_heads_tree_and_runs_it_as_a_tree_with_plain_output(deep_target, heads):
    from app.ui.workbench import DRAFTER_CHOICES, Workbench

    assert DRAFTER_CHOICES.index("eagle3:tree") == DRAFTER_CHOICES.index("eagle3") + 1
    bench = Workbench()
    bench.attach(deep_target)
    bench.backend, bench.head = TorchBackend(), str(heads["midlayer"])
    bound, choice = bench.engine("eagle3:tree", 3)
    assert choice.kind == "eagle3:tree" and bound.drafter.name == "eagle3-tree"
    done = list(bound.engine.generate(PROMPT, SamplingParams(max_new_tokens=30),
                                      drafter=bound.drafter, k=3))[-1]
    assert done.token_ids == plain(deep_target, PROMPT, 30)
    with pytest.raises(SpecdeckError, match="does not draft trees"):
        bench.resolve("ngram:tree")


def test_a_head_under_an_int4_target_drafts_on_8_bit_weights_with_plain_output(heads, tmp_path):
    """The head keeps 8 bits under an int4 target (4-bit head weights took one SmolLM2-135M
    head's first-draft acceptance from 0.109 to 0.087), and output stays plain decoding's."""
    from backends.torch.quantized_linear import Int4Linear, Int8Linear, W8A8Linear
    from tests.tiny import save_hf_folder

    folder = save_hf_folder(tiny_llama(seed=11, vocab=VOCAB, layers=N_LAYERS), tmp_path / "t")
    target = TorchBackend().load(str(folder), device="cpu", dtype="int4")
    assert any(isinstance(m, Int4Linear) for m in target.hf.modules())
    drafter = build(target, heads["midlayer"], "midlayer")
    layers = [m for m in drafter.head.modules() if isinstance(m, (Int4Linear, Int8Linear,
                                                                   W8A8Linear))]
    assert layers and not any(isinstance(m, Int4Linear) for m in layers)
    done = list(SpecEngine(target, drafter, k=4).generate(
        PROMPT, SamplingParams(max_new_tokens=16)))[-1]
    assert done.token_ids == plain(target, PROMPT, 16)
