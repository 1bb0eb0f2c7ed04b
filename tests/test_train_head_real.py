"""`train-head` on SmolLM2-135M (the real model the tests fetch), sized for CI: the trained head
drafts the target's next token on prompts it never saw far more often than a random head,
its speculative output equals plain decoding, and the folder loads through the EAGLE-3 loader
that `--drafter eagle3 --draft` uses."""

from __future__ import annotations

import json

import pytest

from app.bench.prompts import load_prompts
from app.cli import main
from app.train import run
from tests.eagle_heads import write_head

pytestmark = pytest.mark.slow

TRAIN_PROMPTS = 40  # the first 40 MT-bench questions; the held-out ones come from the rest
HELD_OUT = (60, 71)
DRAFT_VOCAB = 8192


def generate(capsys, gguf, prompt: str, *args: str) -> dict:
    code = main(["generate", "--target", str(gguf), "--chat", "--prompt", prompt,
                 "--max-new-tokens", "48", "--dtype", "bfloat16", "--json", *args])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out)


def test_a_head_trained_on_smollm2_drafts_held_out_prompts_and_stays_lossless(
        smollm2_gguf, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path / "home"))
    head = tmp_path / "head"
    summary = run(str(smollm2_gguf), ["mt-bench"], limit=TRAIN_PROMPTS, out=str(head),
                  on_progress=lambda p: None, max_new_tokens=64, gen_batch=40,
                  draft_vocab=DRAFT_VOCAB, epochs=4, depth=3, batch_tokens=512, lr=1e-3)
    assert summary["prompts"] == TRAIN_PROMPTS and summary["answer_tokens"] > 1000
    # SmolLM2-135M: hidden 576, 30 layers, vocabulary 49152
    random_head = write_head(tmp_path / "random", "midlayer", hidden=576, vocab=49152,
                             n_layers=30, seed=0, draft_vocab=DRAFT_VOCAB, scale=0.05)
    trained, untrained = [], []
    for i in HELD_OUT:
        prompt = load_prompts("mt-bench")[i].text
        plain = generate(capsys, smollm2_gguf, prompt, "--drafter", "none")
        # k=1: acceptance is the head's top-1 accuracy at depth 1 on the target's own text
        one = generate(capsys, smollm2_gguf, prompt, "--drafter", "eagle3", "--draft",
                       str(head), "--k", "1")
        four = generate(capsys, smollm2_gguf, prompt, "--drafter", "eagle3", "--draft",
                        str(head), "--k", "4")
        rand = generate(capsys, smollm2_gguf, prompt, "--drafter", "eagle3", "--draft",
                        str(random_head), "--k", "1")
        assert one["token_ids"] == four["token_ids"] == plain["token_ids"]
        assert rand["token_ids"] == plain["token_ids"]
        trained.append(one["acceptance_rate"])
        untrained.append(rand["acceptance_rate"])
    mean_trained, mean_random = sum(trained) / len(trained), sum(untrained) / len(untrained)
    # measured here (2 EPYC cores, bf16): held-out top-1 at depth 1 0.18 teacher-forced after
    # 2,372 answer tokens; acceptance at k=1 on the two held-out prompts 0.07 and 0.21 (mean
    # 0.14) against 0.0 and 0.0 for the random head
    assert summary["held_out_accuracy"][0] > 0.1
    assert mean_trained > mean_random + 0.08, (trained, untrained)
