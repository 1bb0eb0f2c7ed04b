"""`specdeck serve` sheds abandoned, oversized and malformed work, and stops when told to.

A server process over the tiny model with a tight admission (--max-waiting 0, --max-body-mb 1)
takes the HTTP cases; in-process apps over the same tiny engine show where tokenizing runs.
Nothing here waits on a tuned deadline: tests wait for events (a gauge, a counter, a thread
reaching a point), with generous caps only so that a broken server fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.core.engine import SpecEngine
from app.drafters.ngram import NgramDrafter
from app.serve import prometheus
from app.serve.admission import Gate
from app.serve.jobs import DEFAULT_MAX_TOKENS, Served, sampling
from app.serve.requests import ApiError, CompletionRequest
from app.serve.routes import build_app
from tests.serving import CHAT_TEMPLATE, ROOT, save_tiny_model, serve_process
from tests.tiny import tiny_llama

PROMPT = "w5 w9 w12 w5 w9"
LONG = 4000  # tokens a request asks for when it must still be running when the test acts
CAP_S = 120  # only a broken server reaches this


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + CAP_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def base_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    args = ["--target", str(model_dir), "--drafter", "ngram", "--k", "4", "--max-waiting", "0",
            "--max-body-mb", "1"]
    with serve_process(args, log) as (_, url):
        yield url


def samples(base_url: str) -> list[prometheus.Sample]:
    return prometheus.parse(httpx.get(base_url.removesuffix("/v1") + "/metrics").text)


def finished(base_url: str) -> dict[str, float]:
    return prometheus.by_label(samples(base_url), "specdeck:request_success_total",
                               "finished_reason")


def gauge(base_url: str, name: str) -> float:
    return prometheus.total(samples(base_url), f"specdeck:{name}") or 0.0


def post(base_url: str, body: bytes, content_type: str = "application/json",
         path: str = "/completions") -> httpx.Response:
    return httpx.post(base_url + path, content=body, timeout=CAP_S,
                      headers={"Content-Type": content_type})


def ok_completion(base_url: str) -> None:
    reply = httpx.post(base_url + "/completions", timeout=CAP_S,
                       json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 5


# ---- cross-site requests, sizes, queue --------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data", ""])
def test_posts_not_declared_as_json_get_415_and_start_nothing(base_url: str,
                                                              content_type: str) -> None:
    before = finished(base_url)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 5}).encode()
    reply = post(base_url, body, content_type)
    assert reply.status_code == 415
    assert "application/json" in reply.json()["error"]["message"]
    assert finished(base_url) == before
    assert post(base_url, body, "application/json; charset=utf-8").status_code == 200


def test_bodies_over_the_limit_get_413_declared_or_chunked(base_url: str) -> None:
    body = json.dumps({"prompt": "w5 " * 400_000}).encode()  # 1.2 MB against 1 MiB
    declared = post(base_url, body)
    assert declared.status_code == 413 and "--max-body-mb" in declared.json()["error"]["message"]

    def chunks():
        for start in range(0, len(body), 65536):
            yield body[start:start + 65536]
    chunked = httpx.post(base_url + "/completions", content=chunks(), timeout=CAP_S,
                         headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413
    ok_completion(base_url)


def test_a_full_queue_answers_429_with_retry_after(base_url: str) -> None:
    before = finished(base_url).get("abort", 0.0)
    body = {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
    with httpx.stream("POST", base_url + "/completions", json=body, timeout=CAP_S) as stream:
        lines = stream.iter_lines()  # kept: closing this iterator closes the stream
        next(line for line in lines if line.startswith("data:"))
        refused = httpx.post(base_url + "/completions", timeout=CAP_S,
                             json={"prompt": PROMPT, "max_tokens": 5})
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    wait_until(lambda: finished(base_url).get("abort", 0.0) == before + 1, "stream cancelled")
    ok_completion(base_url)


def test_a_non_streaming_request_is_cancelled_when_its_client_leaves(base_url: str) -> None:
    before = finished(base_url)
    tokens_before = gauge(base_url, "generation_tokens_total")
    body = json.dumps({"prompt": PROMPT, "max_tokens": LONG, "temperature": 0}).encode()
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: gauge(base_url, "num_requests_running") == 1, "generation started")
    wait_until(lambda: sum(finished(base_url).values()) == sum(before.values()) + 1,
               "the request finished")
    after = finished(base_url)
    assert after.get("abort", 0.0) == before.get("abort", 0.0) + 1
    assert gauge(base_url, "generation_tokens_total") - tokens_before < LONG
    ok_completion(base_url)


# ---- wrong inputs: 400, never 500 ---------------------------------------------------------

WRONG = [
    ('{"prompt": "w5", "max_tokens": true}', "/completions", "max_tokens"),
    ('{"prompt": "w5", "max_tokens": 5.0}', "/completions", "max_tokens"),
    ('{"prompt": "w5", "stream": "yes"}', "/completions", "stream"),
    ('{"prompt": "w5", "temperature": "0.5"}', "/completions", "temperature"),
    ('{"prompt": [5, true]}', "/completions", "prompt"),
    ('{"prompt": "w5", "seed": false}', "/completions", "seed"),
    ('{"prompt": "w5 \\ud800"}', "/completions", None),
    ('{"prompt": "w5", "model": "\\udfff"}', "/completions", None),
    ('{"prompt": "w5", "\\ud800": 1}', "/completions", None),
    ("[" * 50_000 + "]" * 50_000, "/completions", None),
    ('{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}", "/completions", None),
    ('{"prompt": "w5", "temperature": NaN}', "/completions", None),
    ('{"prompt": "w5", "max_tokens": 1' + "0" * 5000 + "}", "/completions", None),
    ('{"prompt": "w5", "functions": [{"name": "f", "parameters": {}}]}', "/completions",
     "functions"),
    ('{"messages": [{"role": "user", "content": "w5"}], "function_call": "auto"}',
     "/chat/completions", "function_call"),
    ('{"messages": [{"role": "user", "content": 5}]}', "/chat/completions",
     "messages.0.content"),
    ('{"messages": [{"role": "user", "content": "w5"}], '
     '"stream_options": {"include_usage": "yes"}}', "/chat/completions",
     "stream_options.include_usage"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "/chat/completions", None),
]


@pytest.mark.parametrize("raw, path, param", WRONG, ids=[w[0][:40] for w in WRONG])
def test_wrong_types_surrogates_and_nesting_get_400(base_url: str, raw: str, path: str,
                                                    param: str | None) -> None:
    reply = post(base_url, raw.encode(), path=path)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_a_default_max_tokens_is_bounded_by_a_constant_and_the_context() -> None:
    request = CompletionRequest(prompt="w5")
    assert sampling(request, 131072).max_new_tokens == DEFAULT_MAX_TOKENS
    assert sampling(request, 300).max_new_tokens == 300
    assert sampling(CompletionRequest(prompt="w5", max_tokens=9000), 131072).max_new_tokens == 9000


# ---- fuzz -------------------------------------------------------------------------------

TEXT = st.lists(st.characters() | st.sampled_from(
    ["\ud800", "\udfff", "\x00", "\u2028", "😀", "w5 "]), max_size=24).map("".join)
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(TEXT, inner, max_size=4), max_leaves=8)
FIELDS = ["model", "prompt", "messages", "temperature", "top_p", "top_k", "min_p", "seed",
          "stop", "stream", "stream_options", "n", "drafter", "k", "logprobs", "echo",
          "tools", "functions", "response_format", "logit_bias", "user"]
BAD_MAX = (st.booleans() | st.integers(max_value=0) | st.floats() | TEXT
           | st.lists(st.integers(), max_size=2))


def mutated() -> st.SearchStrategy[tuple[str, bytes]]:
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    plain = {"prompt": PROMPT, "max_tokens": 4}
    changes = st.dictionaries(st.sampled_from(FIELDS) | TEXT, VALUES, max_size=3)
    max_tokens = st.none() | st.fixed_dictionaries({"max_tokens": BAD_MAX})
    return st.tuples(st.sampled_from([("/chat/completions", chat), ("/completions", plain)]),
                     changes, max_tokens).map(
        lambda t: (t[0][0], json.dumps({**t[0][1], **t[1], **(t[2] or {})}).encode()))


def nested() -> st.SearchStrategy[tuple[str, bytes]]:
    return st.tuples(st.integers(1, 100_000), st.sampled_from("[{")).map(
        lambda t: ("/completions", (t[1] + '"a":' if t[1] == "{" else t[1]).encode() * t[0]))


def sized() -> st.SearchStrategy[tuple[str, bytes]]:
    return st.integers(0, 420_000).map(
        lambda n: ("/completions", json.dumps({"prompt": "w5 " * n, "max_tokens": 4}).encode()))


BODIES = (mutated() | nested() | sized()
          | st.tuples(st.just("/chat/completions"), st.binary(max_size=64)))


@pytest.mark.heavy  # 150 fuzzed requests
@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=BODIES)
def test_fuzzed_bodies_get_200_or_4xx_never_500(base_url: str, case: tuple[str, bytes]) -> None:
    path, body = case
    reply = post(base_url, body, path=path)
    assert reply.status_code == 200 or 400 <= reply.status_code < 500, reply.text[:500]
    if reply.status_code != 200:
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_the_server_is_healthy_after_the_fuzz(base_url: str) -> None:
    assert httpx.get(base_url.removesuffix("/v1") + "/health").status_code == 200
    ok_completion(base_url)
    wait_until(lambda: gauge(base_url, "num_requests_running") == 0
               and gauge(base_url, "num_requests_waiting") == 0, "the queue drained")


# ---- tokenizing off the event loop (in process) ------------------------------------------

@pytest.fixture
def served() -> Served:
    model = tiny_llama(seed=1)
    model.tokenizer.chat_template = CHAT_TEMPLATE
    return Served(engine=SpecEngine(model, NgramDrafter(), k=4), model_id="tiny",
                  drafter_name="ngram")


def call(served: Served, scenario: Callable) -> object:
    async def run() -> object:
        transport = httpx.ASGITransport(app=build_app(served))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await scenario(client)
    return asyncio.run(run())


def test_health_answers_while_a_prompt_is_being_tokenized(served: Served, monkeypatch) -> None:
    tokenizer = served.engine.target.tokenizer
    encode = tokenizer.encode
    entered, health_answered = threading.Event(), threading.Event()
    seen: list[bool] = []

    def slow_encode(text: str, *args, **kwargs):
        if len(text) > 1000:
            entered.set()
            # on the event loop this would wait out its cap: /health could not run meanwhile
            seen.append(health_answered.wait(CAP_S))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)

    async def scenario(client: httpx.AsyncClient) -> int:
        big = asyncio.create_task(client.post("/v1/completions",
                                              json={"prompt": "w5 " * 1000}))
        await asyncio.to_thread(entered.wait, CAP_S)
        assert (await client.get("/health")).status_code == 200
        health_answered.set()
        return (await big).status_code

    assert call(served, scenario) == 400  # 1000 tokens: longer than the tiny context
    assert seen == [True]


def test_a_far_too_long_prompt_is_refused_from_a_prefix(served: Served, monkeypatch) -> None:
    tokenizer = served.engine.target.tokenizer
    encode = tokenizer.encode
    lengths: list[int] = []

    def counting(text: str, *args, **kwargs):
        lengths.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting)
    prompt = "w5 " * 300_000

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        chat = {"messages": [{"role": "user", "content": prompt}]}
        return [await client.post("/v1/completions", json={"prompt": prompt}),
                await client.post("/v1/chat/completions", json=chat)]

    for reply in call(served, scenario):
        assert reply.status_code == 400
        assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert lengths and max(lengths) < len(prompt) // 10


def test_a_client_that_leaves_before_its_body_is_read_is_no_server_error(
        served: Served) -> None:
    """Found by the soak (tests/test_soak.py): this used to log a ClientDisconnect traceback."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"64")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    arriving = [{"type": "http.request", "body": b'{"prompt": "w5', "more_body": True}]
    sent: list[dict] = []

    async def receive() -> dict:
        return arriving.pop(0) if arriving else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(build_app(served)(scope, receive, send))  # raised ClientDisconnect before
    assert all(m["status"] < 500 for m in sent if m["type"] == "http.response.start")
    assert served.gate.live == 0
    assert served.metrics.finished_by == {}  # nothing started


def test_the_gate_refuses_past_its_queue_and_cancels_everything_on_stop() -> None:
    gate = Gate(max_waiting=1)
    running, waiting = gate.admit(), gate.admit()
    with pytest.raises(ApiError) as full:
        gate.admit()
    assert full.value.status == 429 and int(full.value.headers["Retry-After"]) >= 1
    cancel = threading.Event()
    waiting.watch(cancel)
    gate.stop()
    assert cancel.is_set()
    with pytest.raises(ApiError) as stopping:
        gate.admit()
    assert stopping.value.status == 503
    running.close()
    running.close()  # twice is harmless
    assert gate.live == 1


# ---- start-up and shutdown ----------------------------------------------------------------

@pytest.mark.heavy  # a server of its own each
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_cancels_a_running_stream_and_the_server_exits(
        model_dir: Path, tmp_path: Path, sig: signal.Signals) -> None:
    log = tmp_path / "serve.log"
    args = ["--target", str(model_dir), "--drafter", "ngram", "--k", "4"]
    with serve_process(args, log) as (process, url):
        body = {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
        chunks: list[dict] = []
        with httpx.stream("POST", url + "/completions", json=body, timeout=CAP_S) as stream:
            lines = (json.loads(line[6:]) for line in stream.iter_lines()
                     if line.startswith("data: {"))
            chunks.append(next(lines))
            process.send_signal(sig)
            sent = time.monotonic()
            try:
                chunks.extend(lines)
            except httpx.HTTPError:
                pass  # the server may close the connection instead of ending the stream
        process.wait(timeout=CAP_S)
        print(f"{sig.name} to exit with a stream running: {time.monotonic() - sent:.2f} s")
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert "length" not in finish  # cancelled, not run to its 4000 tokens
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) < LONG
    assert "Traceback" not in log.read_text()


def test_a_port_in_use_fails_before_the_model_loads_naming_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "app", "serve", "--target", str(tmp_path / "no-model"),
             "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=CAP_S)
    assert result.returncode == 2
    assert "--port" in result.stderr and "in use" in result.stderr
    assert "not found" not in result.stderr  # the model was never looked at
    assert "Traceback" not in result.stderr
