"""The table of drafter kinds and its one check: every kind has one record, each backend runs
what it ran before the table, and every surface (the factory, loading, the workbench, the
server, the planner, the backends' make_drafter) refuses a kind with check's one message."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from app import drafters
from app.catalogue import planner
from app.catalogue.registry import load_catalogue
from app.core.protocols import Capabilities, Runs
from app.core.types import SpecdeckError
from app.drafters import kinds
from app.drafters.kinds import BY_NAME, NAMES, TABLE, check
from app.loading import load_engine
from app.pair import Pair
from app.serve.jobs import Served
from app.serve.requests import ApiError
from app.ui.workbench import Workbench
from backends import runs_of
from backends.extras import BACKENDS
from tests.fakes import FakeModel

PLENTY = 10**12  # every drafter fits: only what runs where decides
NEEDS = (kinds.NOTHING, kinds.DRAFT_MODEL, kinds.HEAD, kinds.OWN_LAYERS)
# what each backend ran before the table (the factory's and the planner's rules then)
RAN = {
    "torch": frozenset(NAMES),
    "mlx": frozenset({"none", "ngram", "ngram-tree", "draft", "chain", "eagle3", "eagle",
                      "lookup+eagle3", "lookup+eagle", "medusa", "dflash", "dspark", "mtp",
                      "assistant", "lookahead", "suffix"}),
    "llamacpp": frozenset({"none", "ngram", "ngram-tree", "draft", "chain", "lookahead",
                           "suffix"}),
}
# what the planner picks from: mlx verifies trees now (backends/mlx/tree.py), so lookahead
# and lookup trees are no longer passed over there; llama.cpp planned over LOGITS_ONLY
PLANNED = {"torch": frozenset(NAMES),
           "mlx": RAN["mlx"],
           "llamacpp": frozenset({"none", "ngram", "draft", "chain", "suffix"})}


def target_on(backend: str) -> FakeModel:
    target = FakeModel()
    target.capabilities = runs_of(backend).capabilities
    return target


def everything_at_hand(kind: str, backend: str) -> Workbench:
    """A workbench on backend with a draft model, a head of kind's own and MTP layers."""
    bench = Workbench()
    bench.attach(target_on(backend), draft=FakeModel())
    bench.backend = SimpleNamespace(name=backend)
    bench.head, bench.head_kind, bench.mtp_layers = "/heads/h", BY_NAME[kind].built_as, 1
    return bench


def test_every_kind_has_one_record():
    assert len(NAMES) == len(TABLE) == len(set(NAMES))
    assert drafters.KINDS == NAMES and drafters.CHOICES == ("auto", *NAMES)
    assert all(k.needs in NEEDS and k.trees in (kinds.NEVER, kinds.ALWAYS, kinds.ASKED)
               and k.description for k in TABLE)
    assert all(BY_NAME[k.after_lookup].needs == k.needs for k in TABLE if k.after_lookup)


def test_the_old_kind_sets_are_read_from_the_table():
    assert drafters.NEEDS_DRAFT_MODEL == {"draft", "chain"}
    assert drafters.HEADS == {"medusa", "dflash", "dspark", "eagle3", "eagle", "lookup+eagle3",
                              "lookup+eagle", "assistant"}
    assert set(drafters.TREES) == {"eagle3", "eagle"}
    assert drafters.OWN_MODEL == drafters.HEADS | drafters.NEEDS_DRAFT_MODEL


def test_the_reference_backend_builds_every_kind_that_needs_building():
    needed = {k.built_as for k in TABLE if k.needs != kinds.NOTHING}
    assert needed <= runs_of(kinds.REFERENCE).builds


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_runs_what_it_ran_before_the_table(backend):
    runs = runs_of(backend)
    assert {k for k in NAMES if check(k, runs) is None} == RAN[backend]
    assert {k for k in RAN[backend] if not kinds.chains_only(k, runs)} == PLANNED[backend]


def test_mlx_builds_every_kind_the_reference_backend_builds():
    # Gemma 4's assistant too: mlx-lm 0.32 has no gemma4_assistant, backends/mlx builds it
    assert runs_of("mlx").builds == runs_of(kinds.REFERENCE).builds


@pytest.fixture
def mlx_without_medusa(monkeypatch):
    """MLX as it was before it built Medusa heads: a backend lacking a kind torch builds."""
    import backends
    from backends.mlx.backend import MlxBackend

    runs = replace(runs_of("mlx"), builds=runs_of("mlx").builds - {"medusa"})
    monkeypatch.setitem(backends._RUNS, "mlx", runs)
    monkeypatch.setattr(MlxBackend, "runs", runs)
    return runs


def test_every_surface_refuses_a_kind_the_backend_lacks_with_the_same_message(
        mlx_without_medusa, tmp_path):
    from backends.mlx.backend import MlxBackend

    kind = "medusa"
    message = check(kind, runs_of("mlx")).message
    assert message.endswith("use --backend torch")
    mlx = SimpleNamespace(name="mlx", runs=runs_of("mlx"))
    with pytest.raises(SpecdeckError) as factory:
        drafters.build_drafter(kind, target_on("mlx"), backend=mlx, head="/heads/h")
    with pytest.raises(SpecdeckError) as backend:
        MlxBackend().make_drafter(kind, target_on("mlx"), head="/heads/h")
    with pytest.raises(SpecdeckError) as loading:
        load_engine(SimpleNamespace(k=4, target=str(tmp_path), drafter=kind, draft="/heads/h",
                                    backend="mlx", device="auto", dtype="auto", tree=False))
    target = target_on("mlx")
    served = Served(engine=SimpleNamespace(target=target, drafter=None), model_id="m",
                    drafter_name="ngram", pair=Pair(mlx, target))
    with pytest.raises(ApiError) as server:
        served.drafter_for(kind)
    refusals = [str(factory.value), str(backend.value), str(loading.value), str(server.value),
                everything_at_hand(kind, "mlx").why_not(kind)]
    assert refusals == [message] * 5


def test_the_planner_refuses_a_kind_the_backend_lacks_with_the_same_message(
        mlx_without_medusa):
    catalogue = load_catalogue()
    refused = {o.kind: o.reason for target in ("qwen3-4b", "vicuna-7b-v1.3")
               for o in planner.plan(target, "mlx", "gpu", PLENTY, catalogue=catalogue).refused}
    assert refused["medusa"] == check("medusa", runs_of("mlx")).message


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_workbench_agrees_with_check_for_every_kind(backend):
    runs = runs_of(backend)
    for kind in (*NAMES, *(k + kinds.TREE_SUFFIX for k in drafters.TREES)):
        refusal = check(kind, runs)
        assert everything_at_hand(kind.removesuffix(kinds.TREE_SUFFIX),
                                  backend).why_not(kind) == (refusal.message if refusal else "")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_planner_agrees_with_check_for_every_kind_it_considers(backend):
    """Every catalogue target, planned as each backend plans (llama.cpp over torch's files):
    a kind check refuses is refused with check's message; one check passes is refused only
    for what the planner alone knows (its tree shrinking, downloads, size, a head's τ)."""
    catalogue, runs = load_catalogue(), runs_of(backend)
    files, device = ("torch", "cpu") if backend == "llamacpp" else (backend, "auto")
    considered = set()
    for target in sorted({pair.target.id for pair in catalogue.pairs.values()}):
        plan = planner.plan(target, files, device, PLENTY, catalogue=catalogue, runs=runs)
        for option in (plan.choice, *plan.passed, *plan.refused):
            considered.add(option.kind)
            refusal = check(option.kind, runs)
            if refusal is not None:
                assert option in plan.refused and option.reason == refusal.message
            elif option in plan.refused:
                assert "drafter" not in option.reason.split(":")[0]
    assert considered >= {"mtp", "dflash", "eagle3", "medusa", "draft", "lookahead", "ngram"}


def test_a_tree_is_refused_where_the_target_verifies_chains_naming_both_fixes():
    chains = Capabilities(hidden_states=True, tree_attention=False, reason="not patched")
    assert check("eagle3:tree", capabilities=chains).message.endswith(
        "drop --tree to draft eagle3 chains, or use --backend torch for trees")
    assert check("lookahead", capabilities=chains) is None  # its tree shrinks to a chain


def test_eagle_trees_run_on_mlx_and_a_backend_whose_heads_draft_chains_refuses_naming_fixes():
    for kind in ("eagle3:tree", "eagle:tree", "lookup+eagle3:tree", "lookup+eagle:tree"):
        assert check(kind, runs_of("mlx")) is None, kind
    chains_only = Runs("chains", frozenset({"eagle3"}), Capabilities(hidden_states=True),
                       head_trees=False)
    refusal = check("eagle3:tree", chains_only)
    assert "head drafts chains only" in refusal.message
    assert refusal.message.endswith("drop --tree to draft eagle3 chains, or use --backend "
                                    "torch for trees")
    assert check("eagle3", chains_only, tree=True) == refusal.__class__(
        "eagle3", refusal.reason.replace("'eagle3:tree'", "'eagle3'"), refusal.fix)
    assert check("ngram", chains_only, tree=True) is None  # --tree asks tree drafters only
    assert "does not draft trees" in check("ngram:tree", runs_of("torch")).message


def test_what_is_missing_is_named_where_the_backend_runs_the_kind():
    mlx = runs_of("mlx")
    eagle3_only = Runs("eagle3-only", frozenset({"eagle3"}), Capabilities(hidden_states=True))
    assert "torch backend only" in check("medusa", eagle3_only, has_head=False).message
    assert check("medusa", mlx, has_head=False).message.startswith(
        "drafter 'medusa' needs its head: give --draft HEAD_DIR")
    assert check("chain", mlx, has_draft=False).message.startswith(
        "drafter 'chain' needs a draft model: give --draft PATH")
    assert check("eagle3", mlx, has_head=False).message.startswith(
        "drafter 'eagle3' needs its head: give --draft HEAD_DIR")
    assert check("lookup+eagle", mlx, head_kind="eagle3").message == (
        "drafter 'lookup+eagle' needs a eagle head, and this pair's head is eagle3: pick eagle3")
    assert check("unknown9").message.startswith("unknown drafter 'unknown9': use one of none,")


STUCK = Capabilities(rewind=False, hidden_states=True,
                     reason="layers of type ['linear_attention'] keep a state that cannot be "
                            "rewound")


def stuck_engine_args(tmp_path, drafter: str, monkeypatch) -> SimpleNamespace:
    """load_engine's flags for a target that cannot speculate, on a backend that loads it."""
    import app.pair

    target = FakeModel()
    target.name, target.capabilities = "tiny-hybrid", STUCK
    backend = SimpleNamespace(name="torch", runs=runs_of("torch"), load=lambda *_, **__: target)
    monkeypatch.setattr(app.pair, "load_backend", lambda _name: backend)
    monkeypatch.setattr(app.pair.Pair, "auto", staticmethod(
        lambda *_: app.pair.AutoChoice("chain", "/drafts/d", ("drafter: draft d (the planner's)",
                                                              "not eagle3: none here"))))
    return SimpleNamespace(k=4, target=str(tmp_path), drafter=drafter, draft=None,
                           backend="torch", device="cpu", dtype="float32", tree=False)


def test_auto_on_a_target_that_cannot_speculate_falls_back_to_plain_and_says_why(
        tmp_path, monkeypatch):
    loaded = load_engine(stuck_engine_args(tmp_path, "auto", monkeypatch))
    assert loaded.drafter_name == "none" and loaded.engine.drafter.name == "none"
    assert loaded.notes[0] == ("drafter: none (not chain: tiny-hybrid cannot speculate: "
                               f"{STUCK.reason})")
    assert loaded.notes[1:] == ("not eagle3: none here",)


def test_an_explicit_kind_on_a_target_that_cannot_speculate_is_refused_with_reason_and_fix(
        tmp_path, monkeypatch):
    with pytest.raises(SpecdeckError, match=r"tiny-hybrid cannot speculate: layers of type "
                                            r"\['linear_attention'\].*: use --drafter none"):
        load_engine(stuck_engine_args(tmp_path, "ngram", monkeypatch))


def test_auto_falls_back_to_lookup_where_only_its_choice_cannot_run():
    no_hidden = Capabilities(rewind=True, hidden_states=False, reason="")
    assert kinds.fallback("eagle3", runs_of("torch"), no_hidden) == \
        ("ngram", check("eagle3", runs_of("torch"), capabilities=no_hidden))
    assert kinds.fallback("eagle3", runs_of("torch"), runs_of("torch").capabilities) == \
        ("eagle3", None)
    assert kinds.fallback("ngram", None, STUCK) == ("none", check("ngram", capabilities=STUCK))


def test_auto_takes_lookup_chains_where_the_target_verifies_chains_only():
    chains = Capabilities(hidden_states=True, tree_attention=False,
                          reason="layers of type ['linear_attention'] keep one recurrent state")
    kind, refusal = kinds.fallback("lookahead", runs_of("torch"), chains)
    assert kind == "ngram" and "recurrent state" in refusal.reason
    assert check("eagle3:tree", runs_of("torch"), capabilities=chains, target="t").message == (
        "drafter 'eagle3:tree' drafts trees, and t verifies chains only: layers of type "
        "['linear_attention'] keep one recurrent state: drop --tree to draft eagle3 chains")
