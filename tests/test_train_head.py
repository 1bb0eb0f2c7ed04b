"""`specdeck train-head`: captured states, the draft vocabulary, TTT training, checkpoints, the
saved EAGLE-3 folder and its registration, on tiny random models (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors import safe_open  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from app.train import prompts as training_prompts  # noqa: E402
from backends.torch.head_weights.eagle import Eagle3Head, load_eagle_head  # noqa: E402
from backends.torch.train_head import data, loop  # noqa: E402
from backends.torch.train_head.head import draft_ids, new_head, start_from_target  # noqa: E402
from backends.torch.train_head.ttt import ttt_logits, ttt_step  # noqa: E402
from backends.torch.train_head.vocab import d2t_t2d, draft_vocabulary  # noqa: E402
from tests.tiny import tiny_llama, tiny_tokenizer  # noqa: E402

VOCAB = 48
LAYERS = 8  # so that EAGLE-3's layers 2, N//2 and N-3 differ


def tiny_target(seed: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=1, bos_token_id=0,
                         tie_word_embeddings=False)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # varied greedy answers from a random model
    return hf


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[0, *rng.integers(2, VOCAB, size=int(rng.integers(3, 9))).tolist()] for _ in range(n)]


@pytest.fixture(scope="module")
def answers() -> list[data.Example]:
    hf = tiny_target()
    prompts = random_prompts(24)
    return [e for i in range(0, 24, 8)
            for e in data.generate_examples(hf, prompts[i:i + 8], 24, [1], 1)]


def frozen_parts(hf: LlamaForCausalLM, head: Eagle3Head) -> loop.Frozen:
    embed = torch.nn.Embedding.from_pretrained(hf.model.embed_tokens.weight.detach().clone())
    return loop.Frozen(embed, hf.lm_head.weight.detach()[draft_ids(head)].float())


def fresh_head(hf: LlamaForCausalLM, draft_vocab: int = 40, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = new_head(hf.config, torch.arange(VOCAB - draft_vocab, VOCAB))
    start_from_target(head, hf.lm_head.weight.float(), hf.model.norm.weight.float())
    return head


def test_captured_states_are_the_inputs_of_layers_2_half_and_n_minus_3_under_left_padding():
    hf = tiny_target()
    prompts = [[0, 5, 7, 9, 11, 13], [0, 3, 4]]  # the second is left-padded by 3
    examples = data.generate_examples(hf, prompts, 6, [1], 1)
    assert data.capture_layers(LAYERS) == (2, 4, 5)
    assert data.capture_layers(30) == (2, 15, 27)
    for e, prompt in zip(examples, prompts):
        assert e.tokens[:len(prompt)].tolist() == prompt and e.prompt_len == len(prompt)
        with torch.no_grad():
            hs = hf(e.tokens[None], output_hidden_states=True).hidden_states
        fed = len(e.tokens) - 1  # the last token was never fed back
        want = torch.cat([hs[i][0] for i in data.capture_layers(LAYERS)], dim=-1)
        torch.testing.assert_close(e.aux[:fed], want[:fed], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(e.final[:fed], hs[LAYERS][0][:fed], atol=1e-5, rtol=1e-4)


def test_batched_answers_equal_each_prompts_own_greedy_answer_and_finished_ones_leave():
    hf = tiny_target()
    prompts = random_prompts(6, seed=4)
    fed: list[int] = []
    hook = hf.model.layers[0].register_forward_pre_hook(
        lambda _m, args, kwargs: fed.append((args[0] if args else kwargs["hidden_states"])
                                            .shape[0]), with_kwargs=True)
    examples = data.generate_examples(hf, prompts, 12, [1], 1)
    hook.remove()
    for e, prompt in zip(examples, prompts):
        alone = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            eos_token_id=1, pad_token_id=1)[0].tolist()
        assert e.tokens.tolist() == alone[:len(e.tokens)]
    lengths = sorted(len(e.tokens) - e.prompt_len for e in examples)
    assert lengths[0] < lengths[-1]  # some answers end early
    alive = [sum(n > s for n in lengths) for s in range(lengths[-1])]
    assert fed == alive  # each forward holds only the answers still being written


def test_draft_vocabulary_holds_the_most_frequent_tokens_sorted_with_offsets_and_mask():
    counts = np.zeros(20, dtype=np.int64)
    counts[[17, 3, 9]] = [50, 40, 40]
    ids = draft_vocabulary(counts, 5, multiple=5)
    assert ids.tolist() == [0, 1, 3, 9, 17]  # the 3 seen, then the lowest unseen ids
    assert draft_vocabulary(counts, 2, multiple=5).tolist() == [3, 17]  # ties: the lower id
    d2t, t2d = d2t_t2d(ids, 20)
    assert (np.arange(5) + d2t).tolist() == ids.tolist()
    assert np.all(np.diff(d2t) >= 0) and t2d.sum() == 5 and t2d[ids].all()


def test_draft_vocabulary_stops_at_the_seen_tokens_rounded_up_to_whole_blocks():
    counts = np.zeros(50_000, dtype=np.int64)
    seen = np.arange(1000, 1000 + 70 * 7, 7)  # 70 tokens the answers hold
    counts[seen] = 3
    ids = draft_vocabulary(counts, 32000)
    assert len(ids) == 128  # not 32,000: 70 seen, rounded up to two blocks of 64
    assert set(seen.tolist()) <= set(ids.tolist())
    assert set(ids.tolist()) - set(seen.tolist()) == set(range(58))  # the lowest unseen ids
    assert len(draft_vocabulary(counts, 100)) == 100  # the asked size stays the maximum


def test_answering_reports_each_decode_step_before_its_shard_is_written(tmp_path):
    from app.train import TrainRequest
    from backends.torch.train_head import _answers

    target = save_target(tmp_path / "target")
    prompts = tuple(f"w{i} w{i + 3} w{i + 7}" for i in range(2, 8))
    request = TrainRequest(target_path=str(target), prompts=prompts, work=str(tmp_path / "w"),
                           out=str(tmp_path / "head"), max_new_tokens=10, gen_batch=4,
                           device="cpu", dtype="float32")
    seen: list[tuple[int, bool]] = []
    first_shard = data.shard_path(tmp_path / "w", 0)
    examples = _answers(request, "cpu", tmp_path / "w",
                        lambda p: seen.append((p.done, first_shard.is_file())))
    forwards = max(len(e.tokens) - e.prompt_len for e in examples[:4])  # the first shard's
    before_first_shard = [done for done, saved in seen if not saved]
    # one report before the prompts are read, then one per forward
    assert forwards > 1 and len(before_first_shard) == 1 + forwards
    assert before_first_shard[0] == 0 and before_first_shard[-1] == 4
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
    assert seen[-1][0] == len(prompts)


def test_shard_files_give_back_the_same_examples(answers, tmp_path):
    data.save_shard(data.shard_path(tmp_path, 0), answers[:5])
    back = data.load_shard(data.shard_path(tmp_path, 0))
    for a, b in zip(answers[:5], back):
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        assert torch.equal(a.aux, b.aux) and torch.equal(a.final, b.final)


@pytest.mark.heavy  # trains a head
def test_training_lowers_the_ttt_loss_and_raises_depth_one_accuracy(answers, tmp_path):
    hf = tiny_target()
    head = fresh_head(hf)
    frozen = frozen_parts(hf, head)
    settings = loop.LoopSettings(epochs=30, lr=3e-3, warmup=5, batch_tokens=256, depth=3,
                                 save_every=1000)

    def loss() -> float:
        with torch.no_grad():
            batch = loop.make_batch(answers, list(range(len(answers))), head.t2d, frozen, "cpu")
            return float(ttt_step(head, frozen.embed, batch, 3).loss)

    before, acc_before = loss(), loop.evaluate(head, frozen, answers, 3, 256, "cpu",
                                               False).per_depth
    loop.train(head, frozen, answers, settings, tmp_path, "cpu", False, lambda p: None)
    after, acc_after = loss(), loop.evaluate(head, frozen, answers, 3, 256, "cpu",
                                             False).per_depth
    # the loss keeps the targets' entropy (soft targets); the part the head controls falls
    assert after < before - 1.0
    assert acc_before[0] < 0.2 and acc_after[0] > 0.6 and acc_after[2] > 0.5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ttt_step_j_scores_what_the_chain_drafter_scores_at_its_step_j(tmp_path, temperature):
    """Training and drafting run one step rule: fed the drafter's own chain as data, TTT's
    depth-j logits at the last context row are the drafter's step-j logits, so the accuracy
    per depth that training reports is the acceptance a chain can reach."""
    from app import drafters
    from app.core.engine import SpecEngine
    from app.core.feed import StepFeed
    from app.core.types import SamplingParams
    from backends.torch.backend import TorchBackend
    from backends.torch.head_weights.eagle import save_eagle3

    target = tiny_llama(seed=3, vocab=VOCAB, layers=LAYERS)
    hf = target.hf
    head = fresh_head(hf, seed=4)
    with torch.no_grad():  # a random head whose drafts vary with their context
        for weight in (p for p in head.parameters() if p.dim() == 2):
            weight.normal_(0.0, 0.3)
    folder = save_eagle3(head, tmp_path / "head")
    drafter = drafters.build_drafter("eagle3", target, backend=TorchBackend(), head=str(folder))
    drafter.min_confidence = 0.0  # every step up to depth, however unsure the random head
    prompt, depth = [0, 5, 9, 12, 5, 9, 3, 7, 30], 4
    first = SpecEngine(target).session.forward(prompt, n_logits=1,
                                               capture=drafter.capture_layers)
    drafter.begin(prompt, StepFeed.prompt(prompt, first, 17),
                  SamplingParams(temperature=temperature, seed=0), np.random.default_rng(0))
    context = [*prompt, 17]
    draft = drafter.propose(context, depth)
    sequence = torch.tensor([[*context, *draft.tokens[:-1]]])
    with torch.no_grad():
        states = hf(sequence, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in data.capture_layers(LAYERS)], dim=-1)
        steps = list(ttt_logits(head, hf.get_input_embeddings(), sequence, aux, depth))
    row, ids = len(context) - 2, draft_ids(head)
    for j, logits in enumerate(steps):
        assert int(ids[logits[0, row].argmax()]) == draft.tokens[j] or temperature
        if temperature:
            q = torch.softmax(logits[0, row].double(), -1).numpy()
            np.testing.assert_allclose(draft.probs[j][ids.numpy()], q, atol=1e-5)
    assert len(set(draft.tokens)) > 1


@pytest.mark.heavy  # trains a head, then decodes with it
def test_every_round_of_a_decoding_drafts_what_ttt_scores_on_the_decoded_text(answers,
                                                                               tmp_path):
    """Across a whole speculative decoding, where rounds accept 0..k drafts, each round's
    step-j draft distribution equals TTT's depth-j one on the decoded text wherever the
    round's first j drafts were accepted: the head's cache follows the accepted path round
    after round, so live acceptance can reach what training measures."""
    from app import drafters
    from app.core.engine import SpecEngine, last_done
    from app.core.types import SamplingParams
    from backends.torch.backend import TorchBackend, TorchModel
    from backends.torch.head_weights.eagle import save_eagle3

    hf = tiny_target()
    head = fresh_head(hf)
    loop.train(head, frozen_parts(hf, head), answers,
               loop.LoopSettings(epochs=30, lr=3e-3, warmup=5, batch_tokens=256, depth=3,
                                 save_every=1000), tmp_path / "work", "cpu", False,
               lambda p: None)
    target = TorchModel(hf, tiny_tokenizer(VOCAB), name="tiny-target", device="cpu")
    drafter = drafters.build_drafter("eagle3", target, backend=TorchBackend(),
                                     head=str(save_eagle3(head, tmp_path / "head")))
    drafter.min_confidence = 0.0  # rounds of the controller's k: every depth is compared
    rounds = []
    propose = drafter.propose

    def recorded(context, k):
        draft = propose(context, k)
        rounds.append((len(context), draft))
        return draft

    drafter.propose = recorded
    prompt = random_prompts(24)[2]  # a training prompt: the head knows its answer
    done = last_done(SpecEngine(target).generate(
        prompt, SamplingParams(temperature=1.0, seed=2, max_new_tokens=40),
        drafter=drafter, k=4))
    sequence = torch.tensor([[*prompt, *done.token_ids]])
    with torch.no_grad():
        states = hf(sequence, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in data.capture_layers(LAYERS)], dim=-1)
        steps = [torch.softmax(s[0].double(), -1).numpy()
                 for s in ttt_logits(drafter.head, hf.get_input_embeddings(), sequence, aux, 4)]
    ids, text = draft_ids(drafter.head).numpy(), sequence[0].tolist()
    checked = [0] * 4
    for n_context, draft in rounds:
        for j, q in enumerate(draft.probs if draft.tokens else []):
            if text[n_context:n_context + j] != list(draft.tokens[:j]):
                break  # an earlier draft was rejected: TTT fed other tokens from here on
            np.testing.assert_allclose(q[ids], steps[j][n_context - 2], atol=1e-4)
            checked[j] += 1
    accepted_after_accepting = sum(
        1 for (n, _), (m, _) in zip(rounds, rounds[1:]) if m - n > 1)
    assert checked[0] == len(rounds) > 5 and checked[2] > 0 and accepted_after_accepting > 2


@pytest.mark.heavy  # trains a head
def test_a_chain_counts_a_depth_only_where_every_earlier_depth_was_right(answers, tmp_path):
    """Teacher-forced top-1 at depth j counts rows whatever the earlier depths guessed; a
    greedy chain reaches depth j only where all of them were right, and that is what training
    reports as the chain accuracy (and tau)."""
    hf = tiny_target()
    head = fresh_head(hf)
    frozen = frozen_parts(hf, head)
    loop.train(head, frozen, answers, loop.LoopSettings(epochs=10, lr=3e-3, warmup=5,
                                                        batch_tokens=256, depth=3),
               tmp_path, "cpu", False, lambda p: None)
    batch = loop.make_batch(answers, list(range(len(answers))), head.t2d, frozen, "cpu")
    with torch.no_grad():
        result = ttt_step(head, frozen.embed, batch, 3)
        steps = list(ttt_logits(head, frozen.embed, batch.tokens, batch.aux, 3))
    alive, by_hand = torch.ones_like(batch.counts), []
    for j, logits in enumerate(steps):
        target = torch.zeros_like(batch.target_logits)
        target[:, :target.shape[1] - 1 - j] = batch.target_logits[:, 1 + j:]
        counted = torch.zeros_like(batch.counts)
        counted[:, :counted.shape[1] - 2 - j] = batch.counts[:, 2 + j:]
        alive = alive & counted & (logits.argmax(-1) == target.argmax(-1))
        by_hand.append(int(alive.sum()))
    assert list(result.chained) == by_hand
    assert result.chained[0] == result.correct[0] and result.chained[2] < result.correct[2]
    accuracy = loop.evaluate(head, frozen, answers, 3, 256, "cpu", False)
    assert accuracy.chained[2] < accuracy.per_depth[2]
    assert accuracy.tau == pytest.approx(1 + sum(accuracy.chained))


def test_held_out_accuracy_counts_answer_tokens_outside_the_draft_vocabulary_as_misses(
        answers):
    hf = tiny_target()
    rows = loop.answer_rows(answers, 2)
    for draft_vocab in (VOCAB, 24):
        head = fresh_head(hf, draft_vocab=draft_vocab)
        frozen = frozen_parts(hf, head)
        batch = loop.make_batch(answers, list(range(len(answers))), head.t2d, frozen, "cpu")
        with torch.no_grad():
            result = ttt_step(head, frozen.embed, batch, 2)
        if draft_vocab == VOCAB:
            assert list(result.rows) == rows  # every answer token is in a whole vocabulary
        else:
            assert result.rows[0] < rows[0]
        accuracy = loop.evaluate(head, frozen, answers, 2, 256, "cpu", False)
        assert accuracy.per_depth[0] == pytest.approx(result.correct[0] / rows[0])
        assert accuracy.chained[1] == pytest.approx(result.chained[1] / rows[0])


def test_an_interrupted_run_resumes_from_its_checkpoint_to_the_same_weights(answers, tmp_path):
    hf = tiny_target()
    settings = loop.LoopSettings(epochs=2, lr=1e-3, warmup=2, batch_tokens=128, depth=2,
                                 save_every=3)
    whole = fresh_head(hf)
    loop.train(whole, frozen_parts(hf, whole), answers, settings, tmp_path / "whole", "cpu",
               False, lambda p: None)

    def stop_at_5(p) -> None:
        if p.phase == "train" and p.done == 5:
            raise KeyboardInterrupt

    cut = fresh_head(hf)
    with pytest.raises(KeyboardInterrupt):
        loop.train(cut, frozen_parts(hf, cut), answers, settings, tmp_path / "cut", "cpu",
                   False, stop_at_5)
    assert loop.has_checkpoint(tmp_path / "cut")
    resumed = fresh_head(hf, seed=99)  # other starting weights: the checkpoint must replace them
    summary = loop.train(resumed, frozen_parts(hf, resumed), answers, settings,
                         tmp_path / "cut", "cpu", False, lambda p: None)
    assert summary["steps"] > 5
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_a_checkpoint_for_another_draft_vocabulary_is_not_resumed_and_says_so(answers,
                                                                              tmp_path):
    hf = tiny_target()
    settings = loop.LoopSettings(epochs=1, lr=1e-3, warmup=2, batch_tokens=128, depth=2,
                                 save_every=2)
    before = fresh_head(hf, draft_vocab=40)
    loop.train(before, frozen_parts(hf, before), answers, settings, tmp_path, "cpu", False,
               lambda p: None)
    notes: list[str] = []
    other = fresh_head(hf, draft_vocab=32)
    summary = loop.train(other, frozen_parts(hf, other), answers, settings, tmp_path, "cpu",
                         False, lambda p: notes.append(p.message) if p.phase == "note" else None)
    assert len(notes) == 1 and "draft vocabulary" in notes[0] and "starts over" in notes[0]
    assert summary["steps"] == len(loop.batches(answers, 128, settings.seed, 0))
    again = fresh_head(hf, draft_vocab=32, seed=5)
    loop.train(again, frozen_parts(hf, again), answers, settings, tmp_path, "cpu", False,
               lambda p: notes.append(p.message) if p.phase == "note" else None)
    assert len(notes) == 1  # its own checkpoint resumes without a word
    torch.testing.assert_close(again.lm_head.weight, other.lm_head.weight)


def save_target(folder: Path) -> Path:
    tiny_target().save_pretrained(folder)
    tokenizer = tiny_tokenizer(VOCAB)
    tokenizer.save_pretrained(folder)
    return folder


def test_saved_head_has_the_eagle3_names_shapes_and_config_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path / "home"))
    from app.train import run

    target = save_target(tmp_path / "target")
    jsonl = tmp_path / "prompts.jsonl"
    rng = np.random.default_rng(1)
    jsonl.write_text("".join(json.dumps({"prompt": " ".join(f"w{i}" for i in
                                                            rng.integers(2, VOCAB, 6))}) + "\n"
                             for _ in range(12)))
    summary = run(str(target), [str(jsonl)], out=str(tmp_path / "head"), on_progress=lambda p: None,
                  max_new_tokens=12, gen_batch=4, draft_vocab=32, device="cpu", dtype="float32",
                  epochs=1, depth=2, batch_tokens=128)
    folder = tmp_path / "head"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == VOCAB and config["draft_vocab_size"] == 32
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings"):
        assert key in config
    h, hd = 32, config["head_dim"]
    want = {"fc.weight": [h, 3 * h], "midlayer.input_layernorm.weight": [h],
            "midlayer.hidden_norm.weight": [h],
            "midlayer.self_attn.q_proj.weight": [4 * hd, 2 * h],
            "midlayer.self_attn.k_proj.weight": [2 * hd, 2 * h],
            "midlayer.self_attn.v_proj.weight": [2 * hd, 2 * h],
            "midlayer.self_attn.o_proj.weight": [h, 4 * hd],
            "midlayer.post_attention_layernorm.weight": [h],
            "midlayer.mlp.gate_proj.weight": [64, h], "midlayer.mlp.up_proj.weight": [64, h],
            "midlayer.mlp.down_proj.weight": [h, 64], "norm.weight": [h],
            "lm_head.weight": [32, h], "d2t": [32], "t2d": [VOCAB]}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {k: list(f.get_slice(k).get_shape()) for k in f.keys()} == want
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 32
    assert torch.equal(torch.arange(32) + d2t, torch.nonzero(t2d).flatten())
    head, spec = load_eagle_head(folder, kind="eagle3", target_name="tiny", hidden_size=32,
                                 vocab_size=VOCAB, n_layers=LAYERS)
    assert spec.draft_vocab_size == 32 and torch.equal(head.d2t, d2t)
    lines = (folder / training_prompts.PROMPTS_FILE).read_text().splitlines()
    assert len(lines) == summary["prompts"] == 12
    assert len(summary["held_out_accuracy"]) == len(summary["held_out_chain_accuracy"]) == 2
    assert summary["held_out_tau"] == pytest.approx(1 + sum(summary["held_out_chain_accuracy"]),
                                                    abs=2e-3)


def install_as_smollm2(tmp_path: Path) -> None:
    """The tiny target installed in SPECDECK_HOME under SmolLM2's catalogue id."""
    from app.store import layout

    folder = save_target(tmp_path / "target")
    files = sorted(p.name for p in folder.iterdir())
    layout.install("smollm2-135m-instruct", "torch", [(folder / n, n, None) for n in files],
                   load=".", source="pypi")


def test_the_models_tab_trains_a_head_for_the_pairs_target_with_progress(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path / "home"))
    from app.ui.train import train_head

    install_as_smollm2(tmp_path)
    pages = list(train_head("smollm2-135m+ngram", "mt-bench", 4))
    assert any('data-phase="data"' in p for p in pages)
    assert any('data-phase="train"' in p and "top-1 by depth" in p for p in pages)
    assert 'data-finished="true"' in pages[-1] and "as a chain" in pages[-1]
    assert "smollm2-135m-instruct+eagle3-trained" in pages[-1]
    assert "pick a pair" in next(train_head(None, "mt-bench", 4))


def test_a_head_trained_for_an_installed_model_is_listed_as_a_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path / "home"))
    from app import store
    from app.catalogue import planner
    from app.catalogue.registry import load_catalogue
    from app.store import layout
    from app.train import run

    install_as_smollm2(tmp_path)
    summary = run("smollm2-135m+ngram", ["mt-bench"], limit=6, on_progress=lambda p: None,
                  max_new_tokens=8, gen_batch=3, draft_vocab=16, device="cpu",
                  dtype="float32", epochs=1, depth=2, batch_tokens=128)
    assert summary["pair"] == "smollm2-135m-instruct+eagle3-trained"
    pair = load_catalogue().pair(summary["pair"])
    assert pair.drafter_kind == "eagle3" and pair.target.id == "smollm2-135m-instruct"
    head_path = layout.model_path(pair.drafter, "torch")
    assert head_path is not None and (head_path / "model.safetensors").is_file()
    assert (head_path / "prompts.jsonl").is_file()
    row = next(r for r in store.list_pairs("torch") if r.pair.id == pair.id)
    assert row.installed
    assert store.check_model(pair.drafter, "torch").ok
    plan = planner.plan("smollm2-135m-instruct", "torch", "cpu", memory=2**34,
                        installed=lambda m: store.model_path(m, "torch"))
    assert plan.choice.kind == "eagle3" and plan.choice.path == head_path


def test_prompts_from_a_file_that_a_bundled_benchmark_holds_are_left_out(tmp_path):
    from app.bench.prompts import load_prompts

    bench = load_prompts("humaneval")[0].text
    path = tmp_path / "mine.txt"
    path.write_text("my own question\n\nanother one\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": bench}) + "\n"
                                      + json.dumps({"prompt": "my own question"}) + "\n")
    chosen = training_prompts.collect([str(tmp_path / "b.jsonl"), str(path)])
    assert [p.text for p in chosen.prompts] == ["my own question", "another one"]
    assert chosen.dropped_bench == 1


def test_a_benchmark_leaves_out_the_prompts_a_head_was_trained_on_before_its_limit(tmp_path):
    from app.bench.prompts import load_prompts

    mt = load_prompts("mt-bench")
    first = [p for p in mt if p.category == mt[0].category][:2]
    training_prompts.write(tmp_path, first[:1])
    trained = training_prompts.trained_on(tmp_path)
    kept = load_prompts(f"mt-bench:{mt[0].category}", 1, exclude=trained)
    assert trained == {first[0].text.strip()}
    assert [p.text for p in kept] == [first[1].text]
    assert training_prompts.trained_on(None) == frozenset()
    assert training_prompts.trained_on(tmp_path / "published-head") == frozenset()


def test_the_target_answers_in_the_dtype_it_decodes_with_so_the_head_reads_those_states(
        tmp_path):
    """The states a head is trained on come from the target as sessions run it (fused and
    quantized), not from an unquantized copy: w8a8 states match a w8a8 forward of the whole
    answer to the bit and differ from the fp32 ones."""
    from app.train import TrainRequest
    from backends.torch.backend import TorchBackend
    from backends.torch.quantized_linear import w8a8_is_exact
    from backends.torch.train_head import _answers

    if not w8a8_is_exact():
        pytest.skip("this CPU's int8 matmul is not exact")
    target = save_target(tmp_path / "target")
    request = TrainRequest(target_path=str(target), prompts=("w5 w9 w12 w3",), work=str(tmp_path),
                           out=str(tmp_path / "head"), max_new_tokens=10, gen_batch=1,
                           device="cpu", dtype="w8a8")
    [example] = _answers(request, "cpu", tmp_path, lambda p: None)
    assert data.read_manifest(tmp_path)["dtype"] == "w8a8"
    fed = len(example.tokens) - 1
    states = {}
    for dtype in ("w8a8", "float32"):
        hf = TorchBackend().load(str(target), device="cpu", dtype=dtype).hf
        with torch.no_grad():
            hs = hf(example.tokens[None, :fed], output_hidden_states=True).hidden_states
        states[dtype] = torch.cat([hs[i][0] for i in data.capture_layers(LAYERS)], dim=-1)
    assert torch.equal(example.aux[:fed], states["w8a8"].to(example.aux.dtype))
    assert not torch.allclose(example.aux[:fed].float(), states["float32"], atol=1e-4)
