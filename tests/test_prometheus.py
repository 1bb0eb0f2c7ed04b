"""The Prometheus text parser reads real engines' /metrics, and our own /metrics round-trips.

Fixtures in tests/fixtures/metrics are /metrics pages in the shape vLLM (v1) and SGLang
serve them, with their real metric and label names, taken before and after one request.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from app.serve import prometheus
from app.serve.remote_engine import (
    sglang_counters,
    stats_from_sglang,
    stats_from_vllm,
    vllm_counters,
)

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def page(name: str) -> list[prometheus.Sample]:
    return prometheus.parse((FIXTURES / name).read_text())


def test_vllm_page_yields_every_series_with_its_labels() -> None:
    samples = page("vllm_after.prom")
    drafts = [s for s in samples if s.name == "vllm:spec_decode_num_drafts_total"]
    assert len(drafts) == 1
    assert drafts[0].value == 150.0
    assert drafts[0].label("engine") == "0"
    assert drafts[0].label("model_name") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    buckets = [s for s in samples if s.name == "vllm:time_to_first_token_seconds_bucket"]
    assert [s.label("le") for s in buckets][-1] == "+Inf"


def test_vllm_counters_read_drafts_tokens_and_per_position_acceptance() -> None:
    counters = vllm_counters(page("vllm_after.prom"))
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (150, 600, 381)
    assert counters.accepted_per_pos == (130, 107, 84, 60)
    # _created lines are separate metrics and never leak into the totals
    assert sum(counters.accepted_per_pos) == counters.accepted


def test_vllm_deltas_around_a_request_give_its_run_stats() -> None:
    before, after = vllm_counters(page("vllm_before.prom")), vllm_counters(page("vllm_after.prom"))
    stats = stats_from_vllm(before, after, n_new=111)
    assert stats["drafted"] == 120 and stats["accepted"] == 80
    assert stats["accepted_per_position"] == (26, 22, 19, 13)
    assert stats["drafted_per_position"] == (30, 30, 30, 30)  # k = 120 / 30 drafts
    # 111 tokens = 1 from the prefill + 30 verify forwards each adding 1 + accepted drafts
    assert stats["target_forwards"] == 30


def test_sglang_gauges_and_verify_counter_count_tensor_rank_zero_once() -> None:
    counters = sglang_counters(page("sglang_after.prom"))
    assert counters.accept_length == pytest.approx(3.2)
    assert counters.accept_rate == pytest.approx(0.55)
    assert counters.verify_calls == 1030  # rank 1 repeats the same counter


def test_sglang_deltas_give_forwards_accepted_and_drafted() -> None:
    before = sglang_counters(page("sglang_before.prom"))
    stats = stats_from_sglang(before, sglang_counters(page("sglang_after.prom")), n_new=97)
    assert stats == {"target_forwards": 30, "accepted": 66, "drafted": 120}


def test_sglang_without_the_verify_counter_falls_back_to_accept_length() -> None:
    gauges = sglang_counters(page("sglang_gauges_only.prom"))
    assert gauges.verify_calls is None
    stats = stats_from_sglang(gauges, gauges, n_new=97)
    assert stats["target_forwards"] == 30  # 96 decoded tokens / τ 3.2


@pytest.mark.parametrize("line, name, labels, value", [
    ('a_total{x="1"} 3', "a_total", {"x": "1"}, 3.0),
    ("b 1.5e+06 1700000000000", "b", {}, 1.5e6),  # a timestamp after the value
    ('c{path="a\\"b\\\\c\\nd",k="v"} NaN', "c", {"path": 'a"b\\c\nd', "k": "v"}, math.nan),
    ('d{le="+Inf",} +Inf', "d", {"le": "+Inf"}, math.inf),  # trailing comma is allowed
    ("ns:e_total   7", "ns:e_total", {}, 7.0),
])
def test_sample_lines_parse_names_escaped_labels_and_special_values(
        line: str, name: str, labels: dict[str, str], value: float) -> None:
    [sample] = prometheus.parse(line)
    assert sample.name == name
    assert dict(sample.labels) == labels
    assert sample.value == value or math.isnan(value) and math.isnan(sample.value)


def test_comments_blank_and_broken_lines_are_skipped() -> None:
    text = "# HELP a x\n# TYPE a counter\n\nnot a metric line {\na 1\nb{x=unquoted} 2\n"
    assert [(s.name, s.value) for s in prometheus.parse(text)] == [("a", 1.0)]


def test_render_round_trips_through_parse() -> None:
    text = prometheus.render("specdeck:x_total", "counter", "help text",
                             [({"model_name": 'we"ird\\name', "position": "0"}, 3),
                              ({"model_name": "m", "position": "1"}, 1.5)])
    assert text.startswith("# HELP specdeck:x_total help text\n# TYPE specdeck:x_total counter\n")
    samples = prometheus.parse(text)
    assert [s.label("model_name") for s in samples] == ['we"ird\\name', "m"]
    assert prometheus.by_label(samples, "specdeck:x_total", "position") == {"0": 3.0, "1": 1.5}
    assert prometheus.total(samples, "specdeck:x_total") == 4.5
    assert prometheus.total(samples, "missing") is None
