"""The remote adapter drives an OpenAI-compatible engine and reports runs like a local engine.

End to end: a second `specdeck serve` process (the tiny model drafting for itself, so nearly every
greedy draft is accepted) is the engine. Wire formats of llama-server and vLLM are replayed
from captured shapes through httpx's MockTransport: no such server runs here.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from app import remote_flags
from app.cli import main
from app.core.types import Done, SamplingParams, SpecdeckError, Step
from app.serve.remote_engine import RemoteEngine, connect
from tests.serving import save_tiny_model, specdeck_serve

PROMPT = "w5 w9 w12 w5 w9"
FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def base_url(folder: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    args = ["--target", str(folder), "--drafter", "draft", "--draft", str(folder), "--k", "3"]
    with specdeck_serve(args, log) as url:
        yield url


@pytest.fixture(scope="module")
def remote(base_url: str):
    engine = connect(base_url)
    yield engine
    engine.close()


def run(events) -> tuple[list[Step], Done]:
    *steps, done = list(events)
    assert isinstance(done, Done) and all(isinstance(s, Step) for s in steps)
    return steps, done


def test_adapter_finds_the_served_model_its_drafter_and_k(remote: RemoteEngine) -> None:
    assert remote.kind == "specdeck"
    assert remote.drafter_name == "draft" and remote.k == 3
    assert remote.target.context_length == 4096


def test_streamed_steps_add_up_to_the_server_reply_with_its_statistics(
        remote: RemoteEngine, base_url: str) -> None:
    steps, done = run(remote.generate(PROMPT, SamplingParams(max_new_tokens=30)))
    whole = httpx.post(base_url + "/completions", json={
        "prompt": PROMPT, "max_tokens": 30, "temperature": 0}).json()
    spec = whole["speculative"]
    assert done.error is None and done.stop_reason == "length"
    assert "".join(s.text for s in steps) == done.text == whole["choices"][0]["text"]
    assert list(done.token_ids) == whole["choices"][0]["token_ids"]
    stats = done.stats
    assert stats.n_new_tokens == 30
    # the two runs may draft differently (a prompt lookup can be rejected where the model's
    # own drafts never are), but each reports its counts the same way
    assert stats.drafted >= stats.accepted > 0 and spec["num_draft_tokens"] > 0
    assert stats.acceptance_rate == pytest.approx(stats.accepted / stats.drafted)
    assert stats.mean_accepted_length > 1.0
    assert len(stats.accepted_per_position) == len(spec["accepted_per_position"]) == 3
    assert stats.decode_tok_s > 0
    assert sum(done.from_draft) == stats.accepted


def test_chat_goes_through_the_servers_chat_template(remote: RemoteEngine,
                                                     base_url: str) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    _, done = run(remote.chat(messages, SamplingParams(max_new_tokens=12)))
    whole = httpx.post(base_url + "/chat/completions", json={
        "messages": messages, "max_tokens": 12, "temperature": 0}).json()
    assert done.text == whole["choices"][0]["message"]["content"]
    assert done.stats.n_prompt_tokens == whole["usage"]["prompt_tokens"]


def test_per_request_drafter_none_decodes_plainly_to_the_same_text(
        remote: RemoteEngine, base_url: str) -> None:
    plain = connect(base_url, drafter="none")
    try:
        _, done = run(plain.generate(PROMPT, SamplingParams(max_new_tokens=20)))
    finally:
        plain.close()
    _, reference = run(remote.generate(PROMPT, SamplingParams(max_new_tokens=20)))
    assert done.text == reference.text
    assert done.stats.drafted == 0 and done.stats.mean_accepted_length == 1.0


def test_k_set_between_generations_reaches_the_server(remote: RemoteEngine) -> None:
    remote.k = 1
    try:
        _, done = run(remote.generate(PROMPT, SamplingParams(max_new_tokens=12)))
    finally:
        remote.k = 3
    assert len(done.stats.drafted_per_position) == 1
    assert 0 < done.stats.drafted <= done.stats.target_forwards  # at most one per step


def test_stop_string_is_reported_as_such(remote: RemoteEngine) -> None:
    _, full = run(remote.generate(PROMPT, SamplingParams(max_new_tokens=10)))
    stop = full.text.split()[3]
    _, cut = run(remote.generate(PROMPT, SamplingParams(max_new_tokens=10, stop=(stop,))))
    assert cut.stop_reason == "stop_string"
    assert cut.text == full.text[:full.text.index(stop)]


def test_cancel_stops_the_remote_generation(remote: RemoteEngine, base_url: str) -> None:
    cancel = threading.Event()
    events = remote.generate(PROMPT, SamplingParams(max_new_tokens=4000), cancel=cancel)
    first = next(events)
    assert isinstance(first, Step)
    cancel.set()
    *_, done = list(events)
    assert done.stop_reason == "cancelled"
    assert done.stats.n_new_tokens < 4000
    _, after = run(remote.generate(PROMPT, SamplingParams(max_new_tokens=5)))
    assert after.error is None  # the server's engine took the next request normally


def test_refusals_become_specdeck_errors_naming_the_fix(base_url: str) -> None:
    with pytest.raises(SpecdeckError, match="does not serve 'gpt-4o'; it serves: tiny"):
        connect(base_url, model="gpt-4o")
    with pytest.raises(SpecdeckError, match="cannot reach"):
        connect("http://127.0.0.1:9/v1")
    greedy_k = connect(base_url, k=99)
    with pytest.raises(SpecdeckError, match="refused the request \\(400\\): k:"):
        list(greedy_k.generate(PROMPT, SamplingParams(max_new_tokens=5)))
    greedy_k.close()


# ---- other engines' wire formats -----------------------------------------------------------

def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
        b"data: [DONE]\n\n"


def test_llama_server_timings_fill_the_run_stats() -> None:
    # the final chunk of a llama-server chat stream (choices empty, usage and timings)
    final = {"choices": [], "created": 1779349198, "id": "chatcmpl-x", "model": "q.gguf",
             "object": "chat.completion.chunk",
             "usage": {"completion_tokens": 665, "prompt_tokens": 808, "total_tokens": 1473,
                       "prompt_tokens_details": {"cached_tokens": 804}},
             "timings": {"cache_n": 804, "prompt_n": 4, "prompt_ms": 128.301,
                         "predicted_n": 665, "predicted_ms": 20629.211,
                         "predicted_per_second": 32.2358, "draft_n": 604,
                         "draft_n_accepted": 515}}
    text = {"choices": [{"index": 0, "delta": {"content": "def"}, "finish_reason": None}],
            "object": "chat.completion.chunk"}
    stop = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "object": "chat.completion.chunk"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "q.gguf", "object": "model", "owned_by": "llamacpp"}]})
        assert json.loads(request.content)["stream_options"] == {"include_usage": True}
        return httpx.Response(200, content=_sse(text, stop, final))

    engine = RemoteEngine("http://llama:8080", transport=httpx.MockTransport(handler))
    assert engine.kind == "llama.cpp"
    _, done = run(engine.chat([{"role": "user", "content": "hi"}], SamplingParams()))
    s = done.stats
    assert (done.text, done.stop_reason) == ("def", "eos")
    assert (s.drafted, s.accepted, s.n_new_tokens) == (604, 515, 665)
    assert (s.n_prompt_tokens, s.n_cached_prompt_tokens) == (808, 804)
    assert s.target_forwards == 665 - 1 - 515
    assert s.decode_s == pytest.approx(20.629211)
    assert s.acceptance_rate == pytest.approx(515 / 604)


def test_vllm_counters_before_and_after_fill_the_run_stats() -> None:
    pages = [(FIXTURES / name).read_text() for name in ("vllm_before.prom", "vllm_after.prom")]
    body = {"prompt": None}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "Qwen/Qwen2.5-Coder-1.5B-Instruct", "object": "model",
                 "owned_by": "vllm", "max_model_len": 32768}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=pages.pop(0))
        body["prompt"] = json.loads(request.content)["prompt"]
        chunk = {"object": "text_completion", "choices": [
            {"index": 0, "text": "x = 1", "finish_reason": "length", "stop_reason": None}]}
        usage = {"object": "text_completion", "choices": [],
                 "usage": {"prompt_tokens": 53, "completion_tokens": 111, "total_tokens": 164}}
        return httpx.Response(200, content=_sse(chunk, usage))

    engine = RemoteEngine("http://gpu-box:8000/v1", transport=httpx.MockTransport(handler))
    assert engine.kind == "vllm" and engine.target.context_length == 32768
    _, done = run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=111)))
    s = done.stats
    assert body["prompt"] == [1, 2, 3]
    assert done.stop_reason == "length" and pages == []
    assert (s.drafted, s.accepted, s.target_forwards) == (120, 80, 30)
    assert s.accepted_per_position == (26, 22, 19, 13)
    assert s.mean_accepted_length == pytest.approx(1 + 80 / 30)  # vLLM's own formula


# ---- the user surfaces: specdeck generate --remote -------------------------------------------

def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_remote_json_matches_the_server_and_its_statistics(
        base_url: str, capsys) -> None:
    code, out, err = cli(capsys, "generate", "--remote", base_url, "--prompt", PROMPT,
                         "--max-new-tokens", "20", "--json")
    assert code == 0, err
    result = json.loads(out)
    whole = httpx.post(base_url + "/completions", json={
        "prompt": PROMPT, "max_tokens": 20, "temperature": 0}).json()
    assert result["text"] == whole["choices"][0]["text"]
    assert result["token_ids"] == whole["choices"][0]["token_ids"]
    assert result["backend"] == "remote" and result["target"].startswith("tiny")
    assert result["remote"] == {"url": base_url, "engine": "specdeck"}
    assert result["drafter"] == "draft" and result["k"] == 3
    assert result["drafted"] >= result["accepted"] > 0
    assert result["mean_accepted_length"] > 1.0 and len(result["accepted_per_position"]) == 3
    # specdeck serve sends each drafter's share, not peak memory or k=auto's off steps
    assert {"peak_memory_bytes", "speculation_off_steps"} <= set(result["unreported"])
    assert [d["name"] for d in result["drafters"]] == ["draft"]
    assert sum(d["accepted"] for d in result["drafters"]) == result["accepted"]
    assert result["peak_memory_bytes"] is None
    assert "did not report" in result["note"]


def test_generate_remote_chat_uses_the_servers_chat_endpoint(base_url: str, capsys) -> None:
    code, out, err = cli(capsys, "generate", "--remote", base_url, "--prompt", PROMPT,
                         "--chat", "--max-new-tokens", "12")
    assert code == 0, err
    whole = httpx.post(base_url + "/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
        "temperature": 0}).json()
    assert out == whole["choices"][0]["message"]["content"]
    assert "τ" in err and "specdeck at " + base_url in err


def test_generate_remote_with_drafter_none_reports_plain_decoding(base_url: str,
                                                                  capsys) -> None:
    code, out, _ = cli(capsys, "generate", "--remote", base_url, "--prompt", PROMPT,
                       "--drafter", "none", "--max-new-tokens", "12", "--json")
    result = json.loads(out)
    assert code == 0 and result["drafter"] == "none" and result["drafted"] == 0


def test_a_remote_engine_without_statistics_gets_nulls_not_zeros(capsys) -> None:
    # a plain OpenAI-compatible server: text and usage, no speculative statistics at all
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "owned_by": "someone"}]})
        if request.url.path == "/metrics":
            return httpx.Response(404)
        chunk = {"choices": [{"index": 0, "text": "hello there", "finish_reason": "stop"}]}
        return httpx.Response(200, content=_sse(chunk))

    engine = RemoteEngine("http://plain:1", transport=httpx.MockTransport(handler))
    _, done = run(engine.generate("hi", SamplingParams()))
    result = remote_flags.result_json(done, engine)
    assert result["text"] == "hello there" and result["token_ids"] is None
    assert result["drafted"] is None and result["mean_accepted_length"] is None
    assert result["k"] is None and "openai" in result["note"]
    assert "acceptance ?" in remote_flags.summary(done, engine)


REMOTE_ERRORS = [
    (["--remote", "http://127.0.0.1:9/v1"], "cannot reach"),
    (["--remote", "127.0.0.1:8000"], "--remote takes a server URL like"),
    (["--remote", "{url}", "--model", "gpt-4o"], "does not serve 'gpt-4o'; it serves: tiny"),
    (["--remote", "{url}", "--target", "x"], "--target load"),
    (["--remote", "{url}", "--k", "99"], "refused the request (400)"),
]


@pytest.mark.parametrize("args,message", REMOTE_ERRORS, ids=[m for _, m in REMOTE_ERRORS])
def test_remote_user_errors_are_one_line_and_exit_2(base_url: str, capsys, args,
                                                    message) -> None:
    args = [a.format(url=base_url) for a in args]
    code, _, err = cli(capsys, "generate", "--prompt", PROMPT, *args)
    assert code == 2 and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.heavy  # a server of its own, with a key
def test_a_missing_key_names_the_fix(folder: Path, tmp_path: Path, capsys) -> None:
    args = ["--target", str(folder), "--drafter", "none", "--api-key", "sesame"]
    with specdeck_serve(args, tmp_path / "serve.log") as url:
        code, _, err = cli(capsys, "generate", "--remote", url, "--prompt", PROMPT,
                           "--api-key", "wrong")
        assert code == 2 and "(401)" in err and "--api-key KEY" in err
        code, out, err = cli(capsys, "generate", "--remote", url, "--prompt", PROMPT,
                             "--api-key", "sesame", "--max-new-tokens", "3", "--json")
        assert code == 0 and json.loads(out)["n_new_tokens"] == 3


# ---- specdeck bench --remote ---------------------------------------------------------------

def test_bench_remote_is_one_more_interleaved_configuration(base_url: str, folder: Path,
                                                            tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "echo", "prompt": PROMPT})
                               + "\n" for i in range(2)))
    out = tmp_path / "report.json"
    code, stdout, err = cli(capsys, "bench", "--target", str(folder), "--remote", base_url,
                            "--prompts", str(prompts), "--max-new-tokens", "8", "--k", "3",
                            "--no-chat", "--json", str(out))
    assert code == 0, err
    summary = json.loads(stdout.strip().splitlines()[-1])
    # the default drafter: the planner's choice (a bare folder: prompt lookup)
    assert set(summary["results"]) == {"plain", "auto:ngram k=3", "remote specdeck:draft"}
    report = json.loads(out.read_text())
    remote_config = next(c for c in report["configs"] if c["drafter"] == "remote")
    assert remote_config["remote"]["engine"] == "specdeck"
    assert "peak_memory_bytes" in remote_config["unreported"]
    overall = remote_config["overall"]
    assert overall["identical"] is True  # the same model, greedy: plain's very tokens
    assert overall["tau"] > 1.0 and overall["speedup_median"] is not None
    order = [r["config"] for r in report["runs"]]
    assert order[:3] == order[3:][::-1]  # interleaved A B C, then C B A
    assert "remote specdeck:draft" in stdout


def test_bench_remote_unreachable_fails_before_loading(folder: Path, capsys) -> None:
    code, _, err = cli(capsys, "bench", "--target", str(folder), "--remote",
                       "http://127.0.0.1:9/v1")
    assert code == 2 and "cannot reach" in err and "loading target" not in err


def test_ui_chat_through_a_remote_server_shows_its_reply_and_statistics(
        remote: RemoteEngine, base_url: str) -> None:
    from app.ui.chat import ChatHandlers
    from app.ui.workbench import Workbench
    from tests.test_ui import send

    bench = Workbench()
    bench.attach_remote(connect(base_url))
    frames = send(ChatHandlers(bench), PROMPT, system="", max_new_tokens=12)
    chatbot, turns, stats = frames[-1][:3]
    _, done = run(remote.chat([{"role": "user", "content": PROMPT}],
                              SamplingParams(max_new_tokens=12)))
    assert turns[-1]["content"] == done.text and chatbot[-1]["content"]
    assert 'data-status="done' in stats and 'data-stat="drafter-draft"' in stats
    assert ">?<" not in stats  # a specdeck server reports every statistic


def test_ui_chat_through_a_server_without_statistics_says_what_it_cannot_show() -> None:
    from app.ui.chat import ChatHandlers
    from app.ui.workbench import Workbench
    from tests.test_ui import send

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "owned_by": "someone"}]})
        if request.url.path == "/metrics":
            return httpx.Response(404)
        chunk = {"choices": [{"index": 0, "delta": {"content": "hello there"},
                              "finish_reason": "stop"}]}
        return httpx.Response(200, content=_sse(chunk))

    bench = Workbench()
    bench.attach_remote(RemoteEngine("http://plain:1", transport=httpx.MockTransport(handler)))
    _, turns, stats = send(ChatHandlers(bench), "hi", system="")[-1][:3]
    assert turns[-1]["content"] == "hello there"
    assert "did not report" in stats and ">?<" in stats
    race_error = pytest.raises(SpecdeckError, bench.engine, "ngram", 4)
    assert "needs a local model" in str(race_error.value)


# ---- a real engine nobody here wrote: llama-server on SmolLM2's GGUF (slow) -----------------

@pytest.fixture(scope="module")
def llama_servers(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    """llama-server plain and with SmolLM2 drafting for itself; skips without llama-server."""
    from app.bench import llamacpp
    from tests.test_bench_llamacpp import real_llama_server

    binary = llamacpp.probe(real_llama_server())
    logs = tmp_path_factory.mktemp("llama")
    servers = []
    try:
        for name, draft in (("plain", None), ("draft", str(smollm2_gguf))):
            args = llamacpp.server_args(binary, str(smollm2_gguf), llamacpp.free_port(), 2,
                                        draft=draft)
            servers.append(llamacpp.start_server(binary, args, logs / f"{name}.log"))
        yield {"plain": servers[0].url, "draft": servers[1].url}
    finally:
        for server in servers:
            server.stop()


@pytest.mark.slow
@pytest.mark.llamacpp
def test_llama_server_stream_gives_the_token_ids_of_its_text(llama_servers) -> None:
    engine = connect(llama_servers["plain"], extra={"cache_prompt": False})
    try:
        assert engine.kind == "llama.cpp" and engine.target.name.endswith(".gguf")
        ids = httpx.post(llama_servers["plain"] + "/tokenize",
                         json={"content": "def fibonacci(n):"}).json()["tokens"]
        _, done = run(engine.generate(ids, SamplingParams(max_new_tokens=24)))
    finally:
        engine.close()
    assert done.error is None and done.stop_reason in ("length", "eos")
    assert len(done.token_ids) == done.stats.n_new_tokens > 0
    text = httpx.post(llama_servers["plain"] + "/detokenize",
                      json={"tokens": list(done.token_ids)}).json()["content"]
    assert text == done.text


@pytest.mark.slow
@pytest.mark.llamacpp
def test_llama_server_drafting_for_itself_reports_acceptance_and_equals_plain(
        llama_servers) -> None:
    outputs = {}
    for name, url in llama_servers.items():
        engine = connect(url, extra={"cache_prompt": False})
        try:
            _, outputs[name] = run(engine.chat([{"role": "user", "content": "Count to 20."}],
                                               SamplingParams(max_new_tokens=40)))
        finally:
            engine.close()
    draft = outputs["draft"].stats
    assert draft.drafted > 0 and draft.accepted > 0.5 * draft.drafted
    assert draft.mean_accepted_length > 1.0
    assert outputs["plain"].stats.drafted == 0
    assert outputs["draft"].text == outputs["plain"].text  # greedy speculation is lossless
