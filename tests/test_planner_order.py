"""The planner's order as literal tables: for each catalogue pair's target, the drafter chosen,
each refused one with its reason and each passed over, on a CPU and on CUDA."""

from __future__ import annotations

import pytest

from app.catalogue import planner, preference
from app.catalogue.registry import load_catalogue

PLENTY = 10**12  # every drafter fits: the order alone decides
LARGE = "too large to pay off: 49% of the target's parameters"
PICKLE = ("medusa-vicuna-7b ships only a pickle checkpoint, which specdeck never loads "
          "(safetensors only)")
LARGE_27B = "too large to pay off: 77% of the target's parameters"  # 27B under the 35B-A3B

# pair: (choice, [(refused, reason)], [passed over, best first]); torch on a CPU
ON_CPU = {
    "qwen2.5-coder-1.5b+0.5b": ("draft qwen2.5-coder-0.5b-instruct-q4km", [],
                                ["draft qwen2.5-0.5b-instruct", "ngram", "lookahead"]),
    "smollm2-135m+ngram": ("ngram", [], ["lookahead"]),
    "qwen2.5-7b+0.5b": ("draft qwen2.5-0.5b-instruct", [],
                        ["draft qwen2.5-coder-0.5b-instruct-q4km",
                         "draft qwen2.5-coder-1.5b-instruct-q4km", "draft qwen2.5-1.5b-instruct",
                         "ngram", "lookahead"]),
    "qwen2.5-1.5b+0.5b": ("draft qwen2.5-0.5b-instruct", [],
                          ["draft qwen2.5-coder-0.5b-instruct-q4km", "ngram", "lookahead"]),
    "qwen3-8b+0.6b": ("dspark dspark-qwen3-8b", [("draft qwen3-4b", LARGE)],
                      ["dflash dflash-qwen3-8b", "draft qwen3-0.6b", "ngram", "lookahead"]),
    "qwen3-4b+0.6b": ("dspark dspark-qwen3-4b", [],
                      ["dflash dflash-qwen3-4b", "eagle3 eagle3-qwen3-4b", "draft qwen3-0.6b",
                       "ngram", "lookahead"]),
    "llama3.1-8b+3.2-1b": ("dflash dflash-llama3.1-8b", [],
                           ["eagle3 eagle3-llama3.1-8b", "draft llama3.2-1b-instruct", "ngram",
                            "lookahead"]),
    "mimo-7b+mtp": ("mtp", [], ["ngram", "lookahead"]),
    "qwen3.6-27b+mtp": ("mtp", [], ["draft qwen3.5-4b", "ngram", "lookahead"]),
    "qwen3.6-35b-a3b+mtp": ("mtp", [("draft qwen3.6-27b", LARGE_27B)],
                            ["draft qwen3.5-4b", "ngram", "lookahead"]),
    "qwen3.5-4b+dflash": ("dflash dflash-qwen3.5-4b", [], ["ngram", "lookahead"]),
    # the planner does not rank Gemma 4's assistant: its pairs' targets plan without it
    "gemma-4-e4b+assistant": ("ngram", [], ["lookahead"]),
    "gemma-4-31b+assistant": ("draft gemma-4-e4b", [], ["ngram", "lookahead"]),
    "gpt-oss-20b+ngram": ("ngram", [], ["lookahead"]),
    "vicuna-7b+medusa": ("ngram", [("medusa medusa-vicuna-7b", PICKLE)], ["lookahead"]),
}
# pairs with the same target plan the same: the plan is the target's, not the pair's
ON_CPU["llama3.1-8b+eagle3"] = ON_CPU["llama3.1-8b+dflash"] = \
    ON_CPU["llama3.1-8b+3.2-1b"]
ON_CPU["qwen3-4b+eagle3"] = ON_CPU["qwen3-4b+dflash"] = ON_CPU["qwen3-4b+dspark"] = \
    ON_CPU["qwen3-4b+0.6b"]
ON_CPU["qwen3-8b+dflash"] = ON_CPU["qwen3-8b+dspark"] = ON_CPU["qwen3-8b+0.6b"]

# torch on CUDA: MTP, then shipped heads, then draft models, then
# lookahead before lookup (a GPU verifies a wide tree's rows nearly for free)
ON_CUDA = {
    "qwen2.5-coder-1.5b+0.5b": ("draft qwen2.5-coder-0.5b-instruct-q4km", [],
                                ["draft qwen2.5-0.5b-instruct", "lookahead", "ngram"]),
    "smollm2-135m+ngram": ("lookahead", [], ["ngram"]),
    "qwen2.5-7b+0.5b": ("draft qwen2.5-0.5b-instruct", [],
                        ["draft qwen2.5-coder-0.5b-instruct-q4km",
                         "draft qwen2.5-coder-1.5b-instruct-q4km", "draft qwen2.5-1.5b-instruct",
                         "lookahead", "ngram"]),
    "qwen2.5-1.5b+0.5b": ("draft qwen2.5-0.5b-instruct", [],
                          ["draft qwen2.5-coder-0.5b-instruct-q4km", "lookahead", "ngram"]),
    "qwen3-8b+0.6b": ("dspark dspark-qwen3-8b", [("draft qwen3-4b", LARGE)],
                      ["dflash dflash-qwen3-8b", "draft qwen3-0.6b", "lookahead", "ngram"]),
    "qwen3-4b+0.6b": ("dspark dspark-qwen3-4b", [],
                      ["dflash dflash-qwen3-4b", "eagle3 eagle3-qwen3-4b", "draft qwen3-0.6b",
                       "lookahead", "ngram"]),
    "llama3.1-8b+3.2-1b": ("dflash dflash-llama3.1-8b", [],
                           ["eagle3 eagle3-llama3.1-8b", "draft llama3.2-1b-instruct",
                            "lookahead", "ngram"]),
    "mimo-7b+mtp": ("mtp", [], ["lookahead", "ngram"]),
    "qwen3.6-27b+mtp": ("mtp", [], ["draft qwen3.5-4b", "lookahead", "ngram"]),
    "qwen3.6-35b-a3b+mtp": ("mtp", [("draft qwen3.6-27b", LARGE_27B)],
                            ["draft qwen3.5-4b", "lookahead", "ngram"]),
    "qwen3.5-4b+dflash": ("dflash dflash-qwen3.5-4b", [], ["lookahead", "ngram"]),
    "gemma-4-e4b+assistant": ("lookahead", [], ["ngram"]),
    "gemma-4-31b+assistant": ("draft gemma-4-e4b", [], ["lookahead", "ngram"]),
    "gpt-oss-20b+ngram": ("lookahead", [], ["ngram"]),
    "vicuna-7b+medusa": ("lookahead", [("medusa medusa-vicuna-7b", PICKLE)], ["ngram"]),
}
ON_CUDA["llama3.1-8b+eagle3"] = ON_CUDA["llama3.1-8b+dflash"] = \
    ON_CUDA["llama3.1-8b+3.2-1b"]
ON_CUDA["qwen3-4b+eagle3"] = ON_CUDA["qwen3-4b+dflash"] = \
    ON_CUDA["qwen3-4b+dspark"] = ON_CUDA["qwen3-4b+0.6b"]
ON_CUDA["qwen3-8b+dflash"] = ON_CUDA["qwen3-8b+dspark"] = \
    ON_CUDA["qwen3-8b+0.6b"]

CHOICE_REASONS = {  # the chosen kind's reason, as `models`, generate and the UI print it
    "draft": "the catalogue's draft model for this target",
    "ngram": "needs no model or memory: drafts repeats of the prompt and output",
    "lookahead": ("needs no model: Jacobi iteration drafts n-grams the target itself proposes; "
                  "its tree costs many verify rows per step"),
    "dflash": ("trained for this target: a block drafter shipped for the target: one forward "
               "drafts a whole block"),
    "dspark": ("trained for this target: a block drafter shipped for the target: one forward "
               "drafts a block, and its confidence head says where to cut it"),
    "mtp": ("the target carries 1 native MTP layer(s): trained with the target and inside its "
            "weights: nothing to download"),
}


def table(catalogue, device):
    out = {}
    for pair_id, pair in catalogue.pairs.items():
        plan = planner.plan(pair.target.id, "torch", device, PLENTY, catalogue=catalogue)
        out[pair_id] = (plan.choice.label, [(o.label, o.reason) for o in plan.refused],
                        [o.label for o in plan.passed])
    return out


@pytest.fixture(scope="module")
def catalogue():
    return load_catalogue()


def test_every_catalogue_pair_plans_as_the_table_says_on_a_cpu(catalogue):
    assert table(catalogue, "cpu") == ON_CPU


def test_every_catalogue_pair_plans_as_the_table_says_on_cuda(catalogue):
    assert table(catalogue, "cuda") == ON_CUDA


@pytest.mark.parametrize("pair_id", ["qwen3-8b+0.6b", "smollm2-135m+ngram", "mimo-7b+mtp",
                                     "vicuna-7b+medusa", "qwen2.5-coder-1.5b+0.5b",
                                     "qwen3-4b+eagle3"])
def test_the_chosen_drafter_says_why_and_each_other_why_not(catalogue, pair_id):
    pair = catalogue.pairs[pair_id]
    plan = planner.plan(pair.target.id, "torch", "cuda", PLENTY, catalogue=catalogue)
    assert plan.choice.reason == CHOICE_REASONS[plan.choice.kind]
    lines = plan.reasons()
    assert lines[0] == f"drafter: {plan.choice.label} ({plan.choice.reason})"
    assert len(lines) == 1 + len(plan.refused) + len(plan.passed) + 1
    assert all(line.startswith("not ") for line in lines[1:-1])
    assert all(f"ranked after {plan.choice.kind}" in line
               for line in lines[-1 - len(plan.passed):-1])
    # every kind of the order is named: considered, or said to be absent and why
    named = {o.kind for o in (plan.choice, *plan.refused, *plan.passed, *plan.absent)}
    assert named == {rank.name for rank in preference.PREFERENCE}
    assert lines[-1].startswith("none here: ")


def test_preference_puts_mtp_first_then_block_drafters_heads_draft_models_then_no_model():
    assert planner.preference("torch", "cuda") == (
        "mtp", "dspark", "dflash", "eagle3", "eagle", "medusa", "draft", "lookahead", "ngram")
    assert planner.preference("torch", "cpu")[-2:] == ("ngram", "lookahead")
    assert planner.preference("mlx", "gpu")[-2:] == ("ngram", "lookahead")


def test_on_mlx_lookahead_runs_its_tree_and_ranks_after_lookup(catalogue):
    plan = planner.plan("smollm2-135m+ngram", "mlx", "gpu", PLENTY, catalogue=catalogue)
    assert plan.choice.kind == "ngram"
    assert plan.refused == ()
    assert [o.kind for o in plan.passed] == ["lookahead"]


def test_on_mlx_the_dspark_and_mtp_drafters_are_picked_as_on_torch(catalogue):
    plan = planner.plan("qwen3-4b", "mlx", "gpu", PLENTY, catalogue=catalogue)
    assert plan.choice.label == "dspark dspark-qwen3-4b"
    assert [o.label for o in plan.passed][0] == "dflash dflash-qwen3-4b"
    assert plan.choice.label == planner.plan("qwen3-4b", "torch", "cuda", PLENTY,
                                             catalogue=catalogue).choice.label
    plan = planner.plan("mimo-7b-rl", "mlx", "gpu", PLENTY, catalogue=catalogue)
    assert plan.choice.kind == "mtp"
    assert plan.choice.label == planner.plan("mimo-7b-rl", "torch", "cuda", PLENTY,
                                             catalogue=catalogue).choice.label


def test_on_mlx_medusa_heads_are_weighed_as_on_torch(catalogue):
    mlx, torch_ = (planner.plan("vicuna-7b-v1.3", backend, "cpu", PLENTY, catalogue=catalogue)
                   for backend in ("mlx", "torch"))
    assert mlx.choice.label == torch_.choice.label == "ngram"
    assert [(o.label, o.reason) for o in mlx.refused] == [("medusa medusa-vicuna-7b", PICKLE)]


# ---- surfaces ------------------------------------------------------------------------------


def test_models_and_the_ui_show_what_auto_picks_and_why_not_the_others(tmp_path, monkeypatch):
    from app import store
    from app.store.cli import models_table
    from app.ui.models import catalogue_frame, pair_details
    from app.ui.workbench import Workbench

    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))  # nothing downloaded
    rows = store.list_pairs("torch", "cpu", PLENTY, 4096)
    smol = next(r for r in rows if r.pair.id == "smollm2-135m+ngram")
    assert smol.to_dict()["auto"]["choice"]["kind"] == "ngram"
    assert smol.to_dict()["auto"]["reasons"] == [
        f"drafter: ngram ({CHOICE_REASONS['ngram']})",
        f"not lookahead: ranked after ngram ({CHOICE_REASONS['lookahead']})",
        "none here: mtp (the target carries no MTP layers); dspark, dflash, eagle3, eagle, "
        "medusa (the catalogue ships none for this target); draft (the catalogue has no "
        "smaller smollm2 model)"]
    text = models_table(rows, 4096, why=True)
    assert f"not medusa medusa-vicuna-7b: {PICKLE}" in text
    bench = Workbench(backend="torch", device="cpu")
    table = catalogue_frame(bench)
    here = {r.pair.id: r.plan.choice.kind for r in store.list_pairs("torch", "cpu")}
    assert dict(zip(table["pair"], table["auto picks"])) == here  # the memory free now
    assert "not lookahead: ranked after ngram" in pair_details(bench, "smollm2-135m+ngram")


def test_every_catalogue_pair_gets_the_same_drafter_on_mlx_as_on_torch(catalogue):
    for pair in catalogue.pairs:
        on_cpu = {backend: planner.plan(pair, backend, "cpu", PLENTY, catalogue=catalogue)
                  for backend in ("mlx", "torch")}
        assert on_cpu["mlx"].choice.label == on_cpu["torch"].choice.label, pair
        # on a GPU only the order of the two lookups differs: CUDA puts lookahead's tree first
        mlx = planner.plan(pair, "mlx", "gpu", PLENTY, catalogue=catalogue).choice.label
        cuda = planner.plan(pair, "torch", "cuda", PLENTY, catalogue=catalogue).choice.label
        assert mlx == cuda or (mlx, cuda) == ("ngram", "lookahead"), pair
