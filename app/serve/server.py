"""`specdeck serve`: an OpenAI-compatible HTTP API with speculative stats, over one SpecEngine
(--target) or every installed pair by its id (app/serve/pool.py loads and unloads them).

Knows: the OpenAI response shapes (/v1/models, /v1/chat/completions, /v1/completions, SSE
streaming), the `speculative` object (vLLM's per-request stat names where they exist), FastAPI
and uvicorn; request bodies are app/serve/requests.py's, /metrics app/serve/metrics.py's.
Must not know: array libraries or the step loop; it consumes engine.generate's Step and Done
events.

Threads: each generation runs on its own worker thread, never on the event loop, and so does
each request's parsing and tokenizing (a 20 MB prompt must not freeze /health). The worker
holds engine.lock for the whole generation, so requests queue per model, and it closes the
engine's generator in a finally: a client that disconnects leaves the cache rewound. The
generation's steps, loads and warm-ups themselves run on the process's one compute thread
(app/core/compute.py: OpenMP slows every thread once two have computed).
Admission (app/serve/admission.py) bounds the body size and the queue; a client that leaves,
streaming or not, and server shutdown (SIGTERM, SIGINT) cancel the generation.
No `from __future__ import annotations` here: FastAPI reads the handlers' annotations, and
the handlers are defined inside build_app so that `specdeck --help` never imports FastAPI.
"""

import argparse
import asyncio
import errno
import hmac
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app import drafters
from app.core import compute
from app.core.types import Done, RunStats, SamplingParams, SpecdeckError, Step
from app.drafters.kinds import check, unknown
from app.flags import DEFAULT_K, add_model_arguments
from app.serve.admission import Gate, Ticket, read_body, require_json
from app.serve.metrics import FINISH, Metrics, render_all
from app.serve.pool import DEFAULT_KEEP_ALIVE, Listed, Pool, need_bytes, parse_duration
from app.serve.requests import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Message,
    OpenAIRequest,
    error_body,
    parse_request,
    shown,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# a request without max_tokens gets this many (or the context left, when that is fewer):
# vLLM's default, the whole context, lets one forgotten field hold the engine for minutes
DEFAULT_MAX_TOKENS = 2048
DEFAULT_MAX_BODY_MB = 4.0  # a full 128k-token prompt, as text or token ids, is about 1 MB
DEFAULT_MAX_WAITING = 16
LOCK_POLL_S = 0.05  # a queued worker looks at its cancel flag this often while it waits
# a text this many times the context in characters is checked on a prefix first: tokenizing
# all of a 20 MB prompt took 19 s only to refuse it
PREFIX_CHARS_PER_TOKEN = 16
SHUTDOWN_GRACE_S = 5  # after SIGTERM, cancelled streams have this long to send their end


# ---- the served engine ------------------------------------------------------------------

@dataclass
class Served:
    """One loaded engine and what the server says about it."""

    engine: Any
    model_id: str
    drafter_name: str
    backend_name: str = "?"
    default_k: int | str = DEFAULT_K
    api_key: str | None = None
    metrics: "Metrics" = field(default_factory=lambda: Metrics())
    gate: Gate = field(default_factory=lambda: Gate(DEFAULT_MAX_WAITING))
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)

    draft: Any = None  # the loaded draft model, for requests that ask for a model drafter
    backend: Any = None
    _drafters: dict[str, Any] = field(default_factory=dict)  # built on first request, kept
    # serving the installed pairs: each pair's counters, kept across its unloads
    pair_metrics: dict[str, Metrics] = field(default_factory=dict)

    def drafter_for(self, name: str | None) -> tuple[Any, str]:
        """The drafter a request asks for; ApiError when this server cannot run it."""
        name = name or self.drafter_name
        if name == self.drafter_name:
            return self.engine.drafter, name
        target = self.engine.target
        refusal = (check(name, getattr(self.backend, "runs", None),
                         capabilities=getattr(target, "capabilities", None),
                         # a request names no head folder: heads run as the server's own drafter
                         has_draft=self.draft is not None, has_head=False,
                         target=getattr(target, "name", "this target"))
                   if name in drafters.KINDS else unknown(name))  # no "<kind>:tree" here
        if refusal is not None:
            raise ApiError(refusal.message, "drafter")
        if name not in self._drafters:
            self._drafters[name] = drafters.build_drafter(
                name, self.engine.target, backend=self.backend, draft=self.draft)
        return self._drafters[name], name

    def k_for(self, drafter: str, k: int | None) -> int | str:
        """The request's k, else the engine's own for its drafter, else the default."""
        if drafter == "none":
            if k:
                raise ApiError("drafter 'none' proposes no draft tokens: drop k or choose "
                               "drafter 'ngram'", "k")
            return 0
        if k is not None:
            return k
        return self.engine.k if drafter == self.drafter_name else self.default_k


@dataclass(frozen=True)
class Job:
    """One request, resolved: prompt ids, sampling, drafter and k."""

    prompt_ids: list[int]
    params: SamplingParams
    drafter: Any
    drafter_name: str
    k: int | str  # a count, or "auto"


def chat_prompt(served: Served, request: ChatRequest) -> list[int]:
    from app.core.prompt import chat_ids

    tokenizer = served.engine.target.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(f"{served.model_id} has no chat template: use /v1/completions",
                       "messages")
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": _text(m, i)} for i, m in enumerate(request.messages)]
    refuse_if_far_too_long(served, "\n".join(m["content"] for m in messages), "messages")
    try:
        return chat_ids(tokenizer, messages)
    except Exception as error:  # noqa: BLE001 - a template refusing the conversation
        raise ApiError(f"the chat template refused these messages: {error}",
                       "messages") from error


def _text(message: Message, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    if any(part.type != "text" for part in message.content):
        raise ApiError("only text content parts are supported", f"messages.{index}.content")
    return "".join(part.text or "" for part in message.content)


def completion_prompt(served: Served, request: CompletionRequest) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError("one prompt per request: send the prompts one by one", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        refuse_if_far_too_long(served, prompt, "prompt")
        return list(served.engine.target.tokenizer.encode(prompt))
    vocab = served.engine.target.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(f"prompt token ids must be in [0, {vocab})", "prompt")
    return [int(t) for t in prompt]


def refuse_if_far_too_long(served: Served, text: str, param: str) -> None:
    """Refuse a text whose prefix alone holds twice the context, before tokenizing all of it.

    The prefix's count can exceed the whole text's only by the tokens of the word it cuts;
    twice the context leaves that margin many times over.
    """
    context = served.engine.target.context_length
    prefix_chars = PREFIX_CHARS_PER_TOKEN * context
    if len(text) <= prefix_chars:
        return
    n = len(served.engine.target.tokenizer.encode(text[:prefix_chars]))
    if n > 2 * context:
        raise ApiError(f"the prompt has more than {n} tokens but {served.model_id} takes at "
                       f"most {context} (prompt and reply together): shorten the prompt",
                       param, code="context_length_exceeded")


def prepare(served: Served, chat: bool, raw: bytes) -> tuple[OpenAIRequest, Job]:
    """Parse, tokenize and resolve one body: heavy work, run off the event loop."""
    body = parse_request(ChatRequest if chat else CompletionRequest, raw)
    prompt = chat_prompt(served, body) if chat else completion_prompt(served, body)
    return body, make_job(served, body, prompt)


def prepare_pooled(pool: Pool, chat: bool, raw: bytes) -> tuple[OpenAIRequest, Job, Served]:
    """As prepare, for the pair the body names: loaded (or kept) and held for this request
    until the caller releases it."""
    body = parse_request(ChatRequest if chat else CompletionRequest, raw)
    pool.check_keep_alive(body.keep_alive)
    served = pool.acquire(body.model)
    try:
        prompt = chat_prompt(served, body) if chat else completion_prompt(served, body)
        return body, make_job(served, body, prompt), served
    except BaseException:
        pool.release(served.model_id)
        raise


def make_job(served: Served, request: OpenAIRequest, prompt_ids: list[int]) -> Job:
    if request.model not in (None, served.model_id):
        raise ApiError(f"the model {shown(request.model)} does not exist: this server serves "
                       f"`{served.model_id}`", "model", 404, "model_not_found")
    engine = served.engine
    try:
        engine.check_prompt(prompt_ids)
    except SpecdeckError as error:
        raise ApiError(str(error), "messages" if isinstance(request, ChatRequest)
                       else "prompt", code="context_length_exceeded") from error
    drafter, name = compute.call(served.drafter_for, request.drafter)  # may build a drafter
    return Job(prompt_ids=prompt_ids, params=sampling(request, engine.target.context_length),
               drafter=drafter, drafter_name=name, k=served.k_for(name, request.k))


def sampling(request: OpenAIRequest, context_length: int) -> SamplingParams:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > 16 or any(not s for s in stop):
        raise ApiError("stop takes up to 16 non-empty strings", "stop")
    try:
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=max(request.top_k or 0, 0),
            top_p=1.0 if request.top_p is None else request.top_p,
            min_p=request.min_p or 0.0, seed=request.seed,
            max_new_tokens=(request.max_completion_tokens or request.max_tokens
                            or min(DEFAULT_MAX_TOKENS, context_length)),
            stop=tuple(stop))
    except SpecdeckError as error:
        raise ApiError(str(error)) from error


# ---- running a generation ---------------------------------------------------------------

class Run:
    """One generation on a worker thread; its events reach the event loop through a queue."""

    def __init__(self, served: Served, job: Job, ticket: Ticket | None = None,
                 on_end: Any = None) -> None:
        self.served, self.job = served, job
        self.on_end = on_end  # called once the generation is over (a pool releases the pair)
        self.cancel = threading.Event()
        self.ticket = ticket or served.gate.admit()
        self.ticket.watch(self.cancel)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Step | Done | None] = asyncio.Queue()
        threading.Thread(target=self._work, name="specdeck-generate", daemon=True).start()

    async def events(self) -> AsyncIterator[Step | Done]:
        """Step events then one Done; leaving early (a disconnect) cancels the generation."""
        try:
            while (event := await self._queue.get()) is not None:
                yield event
        finally:
            self.cancel.set()

    def _work(self) -> None:
        metrics, engine = self.served.metrics, self.served.engine
        done: Done | None = None
        ran = False
        metrics.queued_one()
        try:
            if self._wait_for(engine.lock):
                try:
                    metrics.started_one()
                    ran = True
                    done = self._generate(engine)
                finally:
                    engine.lock.release()
        except Exception as error:  # noqa: BLE001 - reported to the client as an error event
            done = Done(text="", token_ids=(), stop_reason="error", stats=RunStats(),
                        error=f"{type(error).__name__}: {error}")
            self._put(done)
        finally:
            self.ticket.close()
            metrics.finished(done, ran)
            if self.on_end is not None:
                self.on_end()
            self._put(None)

    def _wait_for(self, lock: threading.Lock) -> bool:
        """Take the engine's lock; False when cancelled first (a client that left the queue)."""
        while not lock.acquire(timeout=LOCK_POLL_S):
            if self.cancel.is_set():
                return False
        if self.cancel.is_set():
            lock.release()
            return False
        return True

    def _generate(self, engine: Any) -> Done | None:
        done = None
        events = compute.steps(engine.generate(self.job.prompt_ids, self.job.params,
                                               self.cancel, drafter=self.job.drafter,
                                               k=self.job.k))
        try:
            for event in events:
                self._put(event)
                done = event if isinstance(event, Done) else done
        finally:
            events.close()  # runs the engine's finally: the cache is rewound
        return done

    def _put(self, item: Step | Done | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()


# ---- responses --------------------------------------------------------------------------

def speculative_object(stats: RunStats, drafter: str, k: int) -> dict[str, Any]:
    """Per-request speculative stats; vLLM's per-request names where they exist."""
    drafts = stats.drafted_per_position[0] if stats.drafted_per_position else 0
    return {
        "drafter": drafter,
        "num_spec_tokens": k,
        "num_spec_steps": stats.target_forwards,
        "num_drafts": drafts,
        "num_draft_tokens": stats.drafted,
        "num_accepted_draft_tokens": stats.accepted,
        "draft_acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_accepted_length,
        "acceptance_histogram": list(stats.accepted_length_histogram),
        "accepted_per_position": list(stats.accepted_per_position),
        "drafted_per_position": list(stats.drafted_per_position),
        "acceptance_per_position": list(stats.acceptance_per_position),
        # each drafter's share (a chain's members apart): name, drafted, accepted, acceptance
        "drafters": [d.to_dict(stats.target_forwards) for d in stats.drafters],
        "decode_tok_s": stats.decode_tok_s,
        "ttft_s": stats.ttft_s,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "draft_s": stats.draft_s,
        "verify_s": stats.verify_s,
    }


def usage_object(stats: RunStats) -> dict[str, Any]:
    return {"prompt_tokens": stats.n_prompt_tokens, "completion_tokens": stats.n_new_tokens,
            "total_tokens": stats.n_prompt_tokens + stats.n_new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.n_cached_prompt_tokens}}


def stop_reason(done: Done, params: SamplingParams, tokenizer: Any) -> str | None:
    """vLLM's `stop_reason`: the stop string that ended the reply, else None."""
    if done.stop_reason != "stop_string":
        return None
    if len(params.stop) == 1:
        return params.stop[0]
    # the reply is cut before the match: the earliest stop in the full decode is the one
    full = tokenizer.decode(list(done.token_ids))
    found = [(full.find(s), s) for s in params.stop if s in full]
    return min(found)[1] if found else None


class Reply:
    """Builds the JSON of one request's responses: whole, or as SSE chunks."""

    def __init__(self, served: Served, job: Job, chat: bool) -> None:
        self.served, self.job, self.chat = served, job, chat
        prefix = "chatcmpl" if chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def whole(self, done: Done) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                  "finish_reason": FINISH[done.stop_reason],
                                  "stop_reason": self._stop_reason(done),
                                  "token_ids": list(done.token_ids),
                                  "from_draft": list(done.from_draft)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": done.text}
        else:
            choice["text"] = done.text
        return {**self._head(self.object), "choices": [choice],
                "usage": usage_object(done.stats), "speculative": self._speculative(done)}

    def chunk(self, text: str, ids: list[int], flags: list[bool],
              done: Done | None = None, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "token_ids": ids,
                                  "from_draft": flags, "finish_reason": None}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": text} if first
                               else {"content": text} if text else {})
        else:
            choice["text"] = text
        body = {**self._head(self.object + (".chunk" if self.chat else "")),
                "choices": [choice]}
        if done is not None:
            choice["finish_reason"] = FINISH[done.stop_reason]
            choice["stop_reason"] = self._stop_reason(done)
            body["speculative"] = self._speculative(done)
        return body

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        return {**self._head(self.object + (".chunk" if self.chat else "")), "choices": [],
                "usage": usage_object(done.stats), "speculative": self._speculative(done)}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.served.model_id}

    def _speculative(self, done: Done) -> dict[str, Any]:
        k = self.job.k
        # an adaptive engine ("auto") reports the most it may draft: its positions counted
        k = k if isinstance(k, int) else len(done.stats.drafted_per_position)
        return speculative_object(done.stats, self.job.drafter_name, k)

    def _stop_reason(self, done: Done) -> str | None:
        return stop_reason(done, self.job.params, self.served.engine.target.tokenizer)


async def collect(run: Run, receive: Any) -> Done:
    """The Done of a whole (non-streamed) reply; a client that disconnects cancels it."""
    watcher = asyncio.create_task(_cancel_on_disconnect(receive, run.cancel))
    done = None
    try:
        async for event in run.events():
            if isinstance(event, Done):
                done = event
    finally:
        watcher.cancel()
    if done is None or done.stop_reason == "cancelled":
        raise ApiError("the generation was cancelled (the server is shutting down)",
                       status=503, kind="server_error", code="cancelled")
    return done


async def _cancel_on_disconnect(receive: Any, cancel: threading.Event) -> None:
    # the body is read: the next ASGI message is the disconnect (or the response's end)
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel.set()


async def sse(run: Run, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """The stream: one chunk per step that has text, the finish chunk, usage, [DONE]."""
    try:
        async for text in _sse_events(run, reply, include_usage):
            yield text
    finally:
        run.ticket.close()  # the stream is over: the next request may take its place


async def _sse_events(run: Run, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    ids: list[int] = []
    flags: list[bool] = []
    first = True
    async for event in run.events():
        if isinstance(event, Step):
            ids.extend(event.tokens)
            flags.extend(event.from_draft)
            if event.text or first:
                yield _data(reply.chunk(event.text, ids, flags, first=first))
                ids, flags, first = [], [], False
            continue
        if event.error:
            yield _data(error_body(f"generation failed: {event.error}", "server_error"))
        else:
            yield _data(reply.chunk("", ids, flags, done=event))
            if include_usage:
                yield _data(reply.usage_chunk(event))
    yield "data: [DONE]\n\n"


def _data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


# ---- the app ----------------------------------------------------------------------------

def build_app(served: Served, pool: Pool | None = None) -> Any:
    """The FastAPI application for one served engine; with a pool, `served` holds only the
    shared settings (key, gate, body limit) and each request names its pair."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    def authorise(request: Request) -> None:
        if served.api_key and request.url.path != "/health" and not _authorised(
                request.headers.get("authorization", ""), served.api_key):
            raise ApiError("missing or wrong API key: send 'Authorization: Bearer KEY'",
                           status=401, code="invalid_api_key")

    app = FastAPI(title="specdeck", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(authorise)])

    def refusal(body: dict[str, Any], status: int, headers: Any = None) -> Response:
        # ASCII JSON: an error quoting a client's text must never fail to encode
        return Response(json.dumps(body), status_code=status, headers=headers,
                        media_type="application/json")

    @app.exception_handler(ApiError)
    async def _refused(_request: Request, error: ApiError) -> Response:
        return refusal(error.body(), error.status, error.headers)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, error: HTTPException) -> Response:
        code = "not_found" if error.status_code == 404 else None
        return refusal(error_body(str(error.detail), "invalid_request_error", code=code),
                       error.status_code)

    @app.exception_handler(ClientDisconnect)
    async def _left(_request: Request, _error: ClientDisconnect) -> Response:
        # the client left before its body was read: nothing started and nobody reads this
        # (nginx's 499 "client closed request"); not a crash, so no traceback in the log
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _crashed(_request: Request, error: Exception) -> Response:
        return refusal(error_body(f"internal error: {type(error).__name__}: {error}",
                                  "server_error"), 500)

    @app.get("/health")
    async def _health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def _models() -> dict[str, Any]:
        return models_list(served) if pool is None else pool_models_list(pool)

    @app.get("/metrics")
    async def _metrics() -> PlainTextResponse:
        text = (served.metrics.render(served.model_id) if pool is None
                else render_all(served.pair_metrics))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def _complete(request: Request, chat: bool) -> Any:
        require_json(request.headers.get("content-type"))
        ticket = served.gate.admit()
        try:
            raw = await read_body(request.headers.get("content-length"), request.stream(),
                                  served.max_body_bytes)
            if pool is None:
                body, job = await asyncio.to_thread(prepare, served, chat, raw)
                target, on_end = served, None
            else:
                body, job, target = await _prepare_pooled_async(pool, chat, raw)
                on_end = _releaser(pool, target.model_id, body.keep_alive)
        except BaseException:
            ticket.close()
            raise
        reply, run = Reply(target, job, chat), Run(target, job, ticket, on_end)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(run, reply, usage), media_type="text/event-stream")
        try:
            done = await collect(run, request.receive)
        finally:
            ticket.close()
        if done.error:
            return JSONResponse(error_body(f"generation failed: {done.error}", "server_error"),
                                status_code=500)
        return reply.whole(done)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Any:
        return await _complete(request, chat=True)

    @app.post("/v1/completions")
    async def _completions(request: Request) -> Any:
        return await _complete(request, chat=False)

    return app


def models_list(served: Served) -> dict[str, Any]:
    engine = served.engine
    card = {"id": served.model_id, "object": "model", "created": int(time.time()),
            "owned_by": "specdeck", "max_model_len": engine.target.context_length,
            "specdeck": {"drafter": served.drafter_name, "k": engine.k,
                         "backend": served.backend_name, "device": engine.target.device,
                         "dtype": engine.target.dtype}}
    return {"object": "list", "data": [card]}


async def _prepare_pooled_async(pool: Pool, chat: bool, raw: bytes
                                ) -> tuple[OpenAIRequest, Job, Served]:
    """prepare_pooled off the event loop; a request cancelled while its pair loads releases
    the pair once the load ends, so it can still be unloaded later."""
    task = asyncio.ensure_future(asyncio.to_thread(prepare_pooled, pool, chat, raw))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def release(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                pool.release(done.result()[2].model_id)
        task.add_done_callback(release)
        raise


def _releaser(pool: Pool, pair_id: str, keep_alive: Any) -> Any:
    return lambda: pool.release(pair_id, keep_alive)


def pool_models_list(pool: Pool) -> dict[str, Any]:
    """Every installed pair, with the drafter it runs with and whether it is loaded now."""
    cards = []
    for item in pool.listed:
        served = pool.served(item.pair_id)
        info: dict[str, Any] = {"name": item.name, "drafter": item.drafter,
                                "drafter_reason": item.drafter_reason,
                                "loaded": served is not None, "memory_bytes": item.need_bytes}
        if served is not None:
            target = served.engine.target
            info.update(drafter=served.drafter_name, k=served.engine.k,
                        backend=served.backend_name, device=target.device, dtype=target.dtype)
        cards.append({"id": item.pair_id, "object": "model", "created": int(time.time()),
                      "owned_by": "specdeck", "max_model_len": item.context,
                      "specdeck": info})
    return {"object": "list", "data": cards}


def _authorised(header: str, key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


# ---- command line -----------------------------------------------------------------------

def add_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible API with speculative "
                              "stats (/v1/chat/completions, /v1/completions, /metrics)")
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECDECK_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SPECDECK_API_KEY)")
    p.add_argument("--served-model-name", help="model id clients send (default: target name)")
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                   help=f"refuse larger request bodies with 413 (default {DEFAULT_MAX_BODY_MB:g})")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests that may wait while one generates; more get 429 with "
                        f"Retry-After (default {DEFAULT_MAX_WAITING})")
    installed = p.add_argument_group("without --target: every installed pair, by its id")
    installed.add_argument("--keep-alive", default=DEFAULT_KEEP_ALIVE,
                           help="unload a pair idle this long (5m, 30s, 1h; 0 = when its "
                                f"request ends; -1 = never; default {DEFAULT_KEEP_ALIVE}); a "
                                "request's keep_alive overrides it for its pair")
    installed.add_argument("--memory-limit", help="memory the loaded pairs may use, e.g. 16GB "
                           "(default: what is free at start); the planner's sizes decide what "
                           "fits, idle pairs are unloaded to make room")
    installed.add_argument("--max-loaded", type=int, default=0,
                           help="pairs loaded at once at most (default 0: memory decides)")
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.loading import load_engine

    check_limits(args)
    if not args.target:
        return _serve_installed(args)
    listener = listen_socket(args.host, args.port)  # before the model: a taken port fails fast
    loaded = compute.call(load_engine, args)
    engine = loaded.engine
    compute.call(engine.warm_up)  # the first request does not pay for timing the verify costs
    served = Served(engine=engine, model_id=args.served_model_name or engine.target.name,
                    drafter_name=loaded.drafter_name, backend_name=loaded.backend_name,
                    default_k=request_k_default(args.k),
                    api_key=args.api_key or None, gate=Gate(args.max_waiting),
                    max_body_bytes=int(args.max_body_mb * 2**20), draft=loaded.draft,
                    backend=loaded.backend)
    _warn_if_open(args.host, served.api_key)
    for note in getattr(loaded, "notes", ()):
        print(f"specdeck: {note}", file=sys.stderr)
    print(f"specdeck: serving {served.model_id} (drafter {served.drafter_name}, k {engine.k}) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(build_app(served), log_level="warning",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    cancelling_server()(config, served.gate).run(sockets=[listener])
    compute.quiet(SHUTDOWN_GRACE_S)  # the cancelled generation's last step ends inside torch
    return 0


def request_k_default(k: int | str) -> int | str:
    """The server's --k for requests that name their own drafter: a plain server's k 0 would
    turn their drafter off, so they get the default."""
    return k if k == "auto" or (isinstance(k, int) and k > 0) else DEFAULT_K


def _warn_if_open(host: str, api_key: str | None) -> None:
    if host not in LOOPBACK and not api_key:
        print(f"specdeck: warning: serving on {host} without --api-key: anyone who can "
              "reach this machine can use the model", file=sys.stderr)


def _serve_installed(args: argparse.Namespace) -> int:
    """No --target: serve every installed pair by its id, loading each on first use."""
    import uvicorn

    if args.served_model_name:
        raise SpecdeckError("--served-model-name needs --target: without it each installed "
                            "pair is served by its id")
    keep_alive = parse_duration(args.keep_alive, "--keep-alive")
    listed, budget, runtime = installed_pairs(args)
    listener = listen_socket(args.host, args.port)
    front = Served(engine=None, model_id="specdeck", drafter_name=args.drafter,
                   api_key=args.api_key or None, gate=Gate(args.max_waiting),
                   max_body_bytes=int(args.max_body_mb * 2**20))
    pool = Pool(listed, lambda pair_id: _load_pair(args, front, pair_id), budget, keep_alive,
                args.max_loaded, runtime_bytes=runtime,
                log=lambda line: print(f"specdeck: {line}", file=sys.stderr, flush=True))
    _warn_if_open(args.host, front.api_key)
    for item in listed:
        print(f"specdeck: {item.pair_id}: drafter {item.drafter}, needs "
              f"{item.need_bytes / 1e9:.2f} GB", file=sys.stderr)
    print(f"specdeck: serving {len(listed)} installed pair(s) on http://{args.host}:{args.port}"
          f"/v1, each loaded on first use ({pool.usable_bytes / 1e9:.2f} GB usable, keep-alive "
          f"{args.keep_alive})", file=sys.stderr, flush=True)
    pool.start_reaper()
    config = uvicorn.Config(build_app(front, pool), log_level="warning",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    try:
        cancelling_server()(config, front.gate).run(sockets=[listener])
    finally:
        pool.stop()
        compute.quiet(SHUTDOWN_GRACE_S)
    return 0


def installed_pairs(args: argparse.Namespace) -> tuple[list[Listed], int, int]:
    """The installed pairs with the drafter each would run (the planner's choice, or
    --drafter) and its memory need; the memory budget they share, and what the process
    itself takes of it (planner.RUNTIME_BYTES)."""
    from app import store
    from app.catalogue import planner
    from app.catalogue.registry import load_catalogue
    from backends import detect_backend

    catalogue = load_catalogue()
    backend = detect_backend() if args.backend == "auto" else args.backend
    if args.max_loaded < 0:
        raise SpecdeckError(f"--max-loaded must be >= 0 (got {args.max_loaded})")
    budget = (planner.parse_bytes(args.memory_limit) if args.memory_limit
              else planner.available_memory(backend, args.device))
    rows = [r for r in store.list_pairs(backend, args.device, memory=budget, catalogue=catalogue)
            if r.installed]
    if not rows:
        raise SpecdeckError(f"no pair is installed for the {backend} backend: run `specdeck "
                            f"pull {catalogue.default_pair}` (`specdeck models` lists the "
                            "pairs), or give a model with --target PATH")
    listed = []
    for row in rows:
        plan = planner.plan(row.pair.id, backend, args.device, memory=budget,
                            catalogue=catalogue, implemented=drafters.IMPLEMENTED,
                            installed=lambda model: store.model_path(model, backend))
        drafter = args.drafter if args.drafter != "auto" else plan.choice.label
        reason = "--drafter" if drafter == args.drafter else plan.choice.reason
        listed.append(Listed(row.pair.id, row.pair.name, drafter, reason, need_bytes(plan.fit),
                             row.pair.target.arch.context))
    return listed, budget, planner.RUNTIME_BYTES.get(backend, 0)


def _load_pair(args: argparse.Namespace, front: Served, pair_id: str) -> Served:
    """Load one installed pair as --target PAIR would, with the planner's drafter."""
    from app.loading import load_engine

    flags = argparse.Namespace(**{**vars(args), "target": pair_id,
                                  "drafter": args.drafter})
    loaded = compute.call(load_engine, flags)
    compute.call(loaded.engine.warm_up)
    for note in loaded.notes:
        print(f"specdeck: {pair_id}: {note}", file=sys.stderr)
    return Served(engine=loaded.engine, model_id=pair_id, drafter_name=loaded.drafter_name,
                  backend_name=loaded.backend_name,
                  default_k=request_k_default(args.k),
                  api_key=front.api_key, gate=front.gate, max_body_bytes=front.max_body_bytes,
                  draft=loaded.draft, backend=loaded.backend,
                  metrics=front.pair_metrics.setdefault(pair_id, Metrics()))


def check_limits(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise SpecdeckError(f"--port must be in 1..65535 (got {args.port})")
    if not args.max_body_mb > 0:  # also refuses NaN
        raise SpecdeckError(f"--max-body-mb must be > 0 (got {args.max_body_mb})")
    if args.max_waiting < 0:
        raise SpecdeckError(f"--max-waiting must be >= 0 (got {args.max_waiting})")


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now; SpecdeckError naming --port when it is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as error:
        raise SpecdeckError(f"cannot serve on {host}: {error}: give another --host") from error
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart at once
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise SpecdeckError(f"port {port} on {host} is in use (another server?): choose "
                                "another with --port N") from error
        raise SpecdeckError(f"cannot bind {host}:{port}: {error.strerror}: choose another "
                            "--host or --port") from error
    sock.set_inheritable(True)
    return sock


def cancelling_server() -> type:
    """uvicorn's Server, cancelling on shutdown (built here: --help never imports uvicorn)."""
    import uvicorn

    class CancellingServer(uvicorn.Server):
        """uvicorn that cancels live generations on SIGTERM/SIGINT instead of awaiting them."""

        def __init__(self, config: Any, gate: Gate) -> None:
            super().__init__(config)
            self.gate = gate

        def handle_exit(self, sig: int, frame: Any) -> None:
            # runs as a signal handler on the loop's thread: setting the generations' Events
            # there could wait on a lock that thread holds, so another thread does it
            threading.Thread(target=self.gate.stop, name="specdeck-stop").start()
            super().handle_exit(sig, frame)

    return CancellingServer

