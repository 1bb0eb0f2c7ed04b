"""`specdeck serve`: an OpenAI-compatible HTTP API over one SpecEngine, with speculative stats.

Knows: the OpenAI request and response shapes (/v1/models, /v1/chat/completions,
/v1/completions, SSE streaming, error objects), the `speculative` object (vLLM's per-request
stat names where they exist) and /metrics (vLLM's spec_decode_* counters under `specdeck:`),
FastAPI and uvicorn. Must not know: array libraries or the step loop; it consumes the Step
and Done events of engine.generate.

Threads: each generation runs on its own worker thread, never on the event loop. The worker
holds engine.lock for the whole generation, so requests queue per model, and it closes the
engine's generator in a finally: a client that disconnects leaves the cache rewound.
No `from __future__ import annotations` here: FastAPI reads the handlers' annotations, and
the handlers are defined inside build_app so that `specdeck --help` never imports FastAPI.
"""

import argparse
import asyncio
import hmac
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app import prometheus
from app.cli import add_model_arguments
from app.ngram import NgramDrafter, NoDrafter
from app.types import Done, RunStats, SamplingParams, SpecdeckError, Step

MAX_K = 32  # per-request k above this is refused: verify batches grow with k
DEFAULT_K = 4  # k for a per-request drafter when the server itself runs without one
LOOPBACK = ("127.0.0.1", "localhost", "::1")
FINISH = {"eos": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort",
          "error": "error"}


# ---- requests ---------------------------------------------------------------------------

class _StreamOptions(BaseModel):
    include_usage: bool = False


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None


class _Request(BaseModel):
    """Fields both endpoints share; unknown OpenAI fields are ignored, see _UNSUPPORTED."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 disables, as in vLLM
    min_p: float | None = Field(None, ge=0, lt=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = Field(1, ge=1)
    drafter: Literal["none", "ngram", "draft"] | None = None
    k: int | None = Field(None, ge=0, le=MAX_K)


class _ChatRequest(_Request):
    messages: list[_Message] = Field(min_length=1)


class _CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]


# OpenAI fields that would change the output if honoured: refused, never silently ignored
_UNSUPPORTED = {
    "n": lambda v: v != 1,
    "best_of": lambda v: v not in (None, 1),
    "logprobs": lambda v: v not in (None, False, 0),
    "top_logprobs": lambda v: v not in (None, 0),
    "echo": lambda v: bool(v),
    "suffix": lambda v: bool(v),
    "presence_penalty": lambda v: v not in (None, 0),
    "frequency_penalty": lambda v: v not in (None, 0),
    "logit_bias": lambda v: bool(v),
    "tools": lambda v: bool(v),
    "response_format": lambda v: bool(v) and (not isinstance(v, dict)
                                              or v.get("type", "text") != "text"),
}


class ApiError(Exception):
    """A refused request: an OpenAI error object with its status (4xx for bad requests)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def parse_request(model: type[_Request], raw: bytes) -> _Request:
    """The validated request, or ApiError naming the offending field."""
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(f"the request body is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not _type_tag(p)) or None
        raise ApiError(f"{param}: {first['msg']}" if param else first["msg"], param) from error
    for name, refused in _UNSUPPORTED.items():
        if name in data and refused(data[name]):
            raise ApiError(f"{name}={data[name]!r} is not supported by specdeck serve", name)
    return request


def _type_tag(part: str | int) -> bool:
    """Pydantic names the union member in an error's location (`str`, `list[int]`, `_Part`)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                      or part.startswith("_"))


# ---- the served engine ------------------------------------------------------------------

@dataclass
class Served:
    """One loaded engine and what the server says about it."""

    engine: Any
    model_id: str
    drafter_name: str
    backend_name: str = "?"
    default_k: int = DEFAULT_K
    api_key: str | None = None
    metrics: "Metrics" = field(default_factory=lambda: Metrics())

    def drafter_for(self, name: str | None) -> tuple[Any, str]:
        """The drafter object a request asks for; ApiError when this server cannot run it."""
        name = name or self.drafter_name
        if name == self.drafter_name:
            return self.engine.drafter, name
        if name == "none":
            return NoDrafter(), name
        if name == "ngram":
            return NgramDrafter(), name
        raise ApiError(f"drafter {name!r} is not loaded on this server (it runs "
                       f"{self.drafter_name!r}): use drafter 'ngram' or 'none', or restart "
                       "with --drafter draft --draft PATH", "drafter")

    def k_for(self, drafter: str, k: int | None) -> int | None:
        """The request's k; None keeps the engine's own (a number, or adaptive 'auto')."""
        if drafter == "none":
            if k:
                raise ApiError("drafter 'none' proposes no draft tokens: drop k or choose "
                               "drafter 'ngram'", "k")
            return 0
        if k is not None:
            return k
        return None if drafter == self.drafter_name else self.default_k


@dataclass(frozen=True)
class Job:
    """One request, resolved: prompt ids, sampling, drafter and k."""

    prompt_ids: list[int]
    params: SamplingParams
    drafter: Any
    drafter_name: str
    k: int | None  # None: the engine's own k


def chat_prompt(served: Served, request: _ChatRequest) -> list[int]:
    from app.loading import chat_ids

    tokenizer = served.engine.target.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(f"{served.model_id} has no chat template: use /v1/completions",
                       "messages")
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": _text(m, i)} for i, m in enumerate(request.messages)]
    try:
        return chat_ids(tokenizer, messages)
    except Exception as error:  # noqa: BLE001 - a template refusing the conversation
        raise ApiError(f"the chat template refused these messages: {error}",
                       "messages") from error


def _text(message: _Message, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    if any(part.type != "text" for part in message.content):
        raise ApiError("only text content parts are supported", f"messages.{index}.content")
    return "".join(part.text or "" for part in message.content)


def completion_prompt(served: Served, request: _CompletionRequest) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError("one prompt per request: send the prompts one by one", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(served.engine.target.tokenizer.encode(prompt))
    vocab = served.engine.target.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(f"prompt token ids must be in [0, {vocab})", "prompt")
    return [int(t) for t in prompt]


def make_job(served: Served, request: _Request, prompt_ids: list[int]) -> Job:
    if request.model not in (None, served.model_id):
        raise ApiError(f"the model `{request.model}` does not exist: this server serves "
                       f"`{served.model_id}`", "model", 404, "model_not_found")
    engine = served.engine
    try:
        engine.check_prompt(prompt_ids)
    except SpecdeckError as error:
        raise ApiError(str(error), "messages" if isinstance(request, _ChatRequest)
                       else "prompt", code="context_length_exceeded") from error
    drafter, name = served.drafter_for(request.drafter)
    return Job(prompt_ids=prompt_ids, params=sampling(request, engine.target.context_length),
               drafter=drafter, drafter_name=name, k=served.k_for(name, request.k))


def sampling(request: _Request, context_length: int) -> SamplingParams:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > 16 or any(not s for s in stop):
        raise ApiError("stop takes up to 16 non-empty strings", "stop")
    try:
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=max(request.top_k or 0, 0),
            top_p=1.0 if request.top_p is None else request.top_p,
            min_p=request.min_p or 0.0, seed=request.seed,
            max_new_tokens=request.max_completion_tokens or request.max_tokens or context_length,
            stop=tuple(stop))
    except SpecdeckError as error:
        raise ApiError(str(error)) from error


# ---- running a generation ---------------------------------------------------------------

@contextmanager
def configured(engine: Any, drafter: Any, k: int | None) -> Iterator[None]:
    """The engine with this request's drafter and k; restored afterwards (caller holds lock).

    A fixed k also sets aside an adaptive-k controller for this request, if the engine has one.
    """
    saved = engine.drafter, engine.k, getattr(engine, "controller", None)
    engine.drafter = drafter
    if k is not None:
        engine.k = k
        if saved[2] is not None:
            engine.controller = None
    try:
        yield
    finally:
        engine.drafter, engine.k = saved[:2]
        if saved[2] is not None:
            engine.controller = saved[2]


class Run:
    """One generation on a worker thread; its events reach the event loop through a queue."""

    def __init__(self, served: Served, job: Job) -> None:
        self.served, self.job = served, job
        self.cancel = threading.Event()
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
            with engine.lock:
                metrics.started_one()
                ran = True
                if not self.cancel.is_set():
                    done = self._generate(engine)
        except Exception as error:  # noqa: BLE001 - reported to the client as an error event
            done = Done(text="", token_ids=(), stop_reason="error", stats=RunStats(),
                        error=f"{type(error).__name__}: {error}")
            self._put(done)
        finally:
            metrics.finished(done, ran)
            self._put(None)

    def _generate(self, engine: Any) -> Done | None:
        done = None
        with configured(engine, self.job.drafter, self.job.k):
            events = engine.generate(self.job.prompt_ids, self.job.params, self.cancel)
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
        k = self.job.k if self.job.k is not None else self.served.engine.k
        # an adaptive engine ("auto") reports the most it may draft: its positions counted
        k = k if isinstance(k, int) else len(done.stats.drafted_per_position)
        return speculative_object(done.stats, self.job.drafter_name, k)

    def _stop_reason(self, done: Done) -> str | None:
        return stop_reason(done, self.job.params, self.served.engine.target.tokenizer)


async def collect(run: Run) -> Done:
    done = None
    async for event in run.events():
        if isinstance(event, Done):
            done = event
    if done is None:
        raise ApiError("the generation was cancelled", status=503, kind="server_error")
    return done


async def sse(run: Run, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """The stream: one chunk per step that has text, the finish chunk, usage, [DONE]."""
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


# ---- metrics ----------------------------------------------------------------------------

# name under `specdeck:` -> (help, what one finished request adds); vLLM's names and help
COUNTERS = {
    "spec_decode_num_drafts": ("Number of spec decoding drafts.",
                               lambda s: s.drafted_per_position[0] if s.drafted_per_position
                               else 0),
    "spec_decode_num_draft_tokens": ("Number of draft tokens.", lambda s: s.drafted),
    "spec_decode_num_accepted_tokens": ("Number of accepted tokens.", lambda s: s.accepted),
    "prompt_tokens": ("Number of prefill tokens processed.", lambda s: s.n_prompt_tokens),
    "generation_tokens": ("Number of generation tokens processed.", lambda s: s.n_new_tokens),
}


class Metrics:
    """Counters since the server started, served as Prometheus text at /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.accepted_per_pos: list[int] = []
        self.finished_by: dict[str, int] = {}
        self.running = self.queued = 0

    def queued_one(self) -> None:
        with self._lock:
            self.queued += 1

    def started_one(self) -> None:
        with self._lock:
            self.queued -= 1
            self.running += 1

    def finished(self, done: Done | None, ran: bool) -> None:
        """Count one finished request; done is None when it left the queue unanswered."""
        reason = FINISH[done.stop_reason] if done is not None else "abort"
        with self._lock:
            self.running -= 1 if ran else 0
            self.queued -= 0 if ran else 1
            self.finished_by[reason] = self.finished_by.get(reason, 0) + 1
            if done is None:
                return
            for name, (_, added) in COUNTERS.items():
                self.totals[name] += added(done.stats)
            per_pos = done.stats.accepted_per_position
            self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
            for j, n in enumerate(per_pos):
                self.accepted_per_pos[j] += n

    def render(self, model: str) -> str:
        label = {"model_name": model}
        with self._lock:
            families = self._families(label)
        return "".join(prometheus.render(*family) for family in families)

    def _families(self, label: dict[str, str]) -> list[tuple]:
        families = [(f"specdeck:{name}_total", "counter", doc, [(label, self.totals[name])])
                    for name, (doc, _) in COUNTERS.items()]
        families += [
            ("specdeck:spec_decode_num_accepted_tokens_per_pos_total", "counter",
             "Accepted tokens per draft position.",
             [({**label, "position": str(j)}, n) for j, n in enumerate(self.accepted_per_pos)]),
            ("specdeck:request_success_total", "counter", "Count of finished requests.",
             [({**label, "finished_reason": r}, n) for r, n in sorted(self.finished_by.items())]),
            ("specdeck:num_requests_running", "gauge", "Requests generating now.",
             [(label, self.running)]),
            ("specdeck:num_requests_waiting", "gauge", "Requests queued for the engine.",
             [(label, self.queued)]),
        ]
        return families


# ---- the app ----------------------------------------------------------------------------

def build_app(served: Served) -> Any:
    """The FastAPI application for one served engine."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    def authorise(request: Request) -> None:
        if served.api_key and request.url.path != "/health" and not _authorised(
                request.headers.get("authorization", ""), served.api_key):
            raise ApiError("missing or wrong API key: send 'Authorization: Bearer KEY'",
                           status=401, code="invalid_api_key")

    app = FastAPI(title="specdeck", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(authorise)])

    @app.exception_handler(ApiError)
    async def _refused(_request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, error: HTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else None
        return JSONResponse(error_body(str(error.detail), "invalid_request_error", code=code),
                            status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _crashed(_request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {error}",
                                       "server_error"), status_code=500)

    @app.get("/health")
    async def _health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def _models() -> dict[str, Any]:
        return models_list(served)

    @app.get("/metrics")
    async def _metrics() -> PlainTextResponse:
        return PlainTextResponse(served.metrics.render(served.model_id),
                                 media_type="text/plain; version=0.0.4")

    async def _complete(request: Request, chat: bool) -> Any:
        body = parse_request(_ChatRequest if chat else _CompletionRequest, await request.body())
        prompt = chat_prompt(served, body) if chat else completion_prompt(served, body)
        job = make_job(served, body, prompt)
        reply, run = Reply(served, job, chat), Run(served, job)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(run, reply, usage), media_type="text/event-stream")
        done = await collect(run)
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
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.loading import load_engine

    if not 0 < args.port < 65536:
        raise SpecdeckError(f"--port must be in 1..65535 (got {args.port})")
    loaded = load_engine(args)
    engine = loaded.engine
    served = Served(engine=engine, model_id=args.served_model_name or engine.target.name,
                    drafter_name=loaded.drafter_name, backend_name=loaded.backend_name,
                    default_k=args.k if isinstance(args.k, int) and args.k > 0 else DEFAULT_K,
                    api_key=args.api_key or None)
    if args.host not in LOOPBACK and not served.api_key:
        print(f"specdeck: warning: serving on {args.host} without --api-key: anyone who can "
              "reach this machine can use the model", file=sys.stderr)
    for note in getattr(loaded, "notes", ()):
        print(f"specdeck: {note}", file=sys.stderr)
    print(f"specdeck: serving {served.model_id} (drafter {served.drafter_name}, k {engine.k}) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(build_app(served), host=args.host, port=args.port, log_level="warning")
    return 0
