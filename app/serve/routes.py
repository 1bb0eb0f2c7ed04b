"""The HTTP routes: /v1/models, /v1/chat/completions, /v1/completions, /health, /metrics, with
authentication and admission.

Knows: FastAPI, the served engine or the pool, jobs, the relay and replies.
Must not know: argparse or sockets.
No `from __future__ import annotations` here: FastAPI reads the handlers' annotations, and
the handlers are defined inside build_app so that `specdeck --help` never imports FastAPI.
"""

import asyncio
import json
import time
from typing import Any

from app.serve.admission import read_body, require_json
from app.serve.jobs import Job, Served, prepare, prepare_pooled
from app.serve.metrics import render_all
from app.serve.pool import Pool
from app.serve.relay import Run
from app.serve.replies import Reply, collect, sse
from app.serve.requests import ApiError, OpenAIRequest, error_body


def build_app(served: Served, pool: Pool | None = None) -> Any:
    """The FastAPI application for one served engine; with a pool, `served` holds only the
    shared settings (key, gate, body limit) and each request names its pair."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    def authorise(request: Request) -> None:
        # each key's requests record into, and draft from, that key's history only
        request.state.partition = served.partition_of(
            _bearer(request.headers.get("authorization", "")))
        if request.state.partition is None and request.url.path != "/health":
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
        text = (served.metrics.render(served.model_id) + history_gauges(served)
                + stream_gauges(served)
                if pool is None else render_all(served.pair_metrics))
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
        job = job.for_partition(request.state.partition)
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
    streams = served.streams
    if streams is not None:
        card["specdeck"]["streams"] = {"slots": streams.slots,
                                       "context": streams.capacity.context,
                                       "why": streams.capacity.reason,
                                       "fit_speculating": streams.capacity.fit_speculating,
                                       "fit_plain": streams.capacity.fit_plain}
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


def stream_gauges(served: Served) -> str:
    """The scheduler's slots, live and waiting streams, and the last forward's load."""
    from app.serve import prometheus

    streams = served.streams
    if streams is None:
        return ""
    label = {"model_name": served.model_id}
    load = streams.last_load
    return "".join(prometheus.render(*family) for family in (
        ("specdeck:stream_slots", "gauge", "Streams that fit at once (memory and --parallel).",
         [(label, streams.slots)]),
        *_fit_gauges(streams.capacity, label),
        ("specdeck:streams_live", "gauge", "Streams generating now, stepped together.",
         [(label, streams.live)]),
        ("specdeck:streams_waiting", "gauge", "Requests waiting for a slot.",
         [(label, streams.waiting)]),
        ("specdeck:step_streams", "gauge", "Streams in the last batched forward.",
         [(label, load.streams)]),
        ("specdeck:step_rows", "gauge", "Rows in the last batched forward.",
         [(label, load.rows)])))


def _fit_gauges(capacity: Any, label: dict[str, str]) -> list[tuple[Any, ...]]:
    """What memory holds with speculation and without, where the memory is known."""
    figures = (("speculating", "with the draft model's KV beside each",
                capacity.fit_speculating),
               ("plain", "with speculation off", capacity.fit_plain))
    return [(f"specdeck:streams_fit_{name}", "gauge",
             f"Streams of {capacity.context} tokens memory holds {words}.", [(label, fit)])
            for name, words, fit in figures if fit is not None]


def history_gauges(served: Served) -> str:
    """The history's size against its bounds (app/store/history.py), where one is kept."""
    from app.serve import prometheus
    from app.store.history import stats

    live = getattr(served.engine, "recorder", None)
    if live is None:
        return ""
    label = {"model_name": served.model_id}
    on_disk = sum(s.bytes for s in stats())
    return "".join(prometheus.render(*family) for family in (
        ("specdeck:history_tokens", "gauge", "Tokens the history holds in memory.",
         [(label, live.memory_tokens())]),
        ("specdeck:history_max_tokens", "gauge", "Tokens a history partition may hold.",
         [(label, live.store.bounds.max_tokens)]),
        ("specdeck:history_disk_bytes", "gauge", "Bytes the history folder takes on disk.",
         [(label, on_disk)]),
        ("specdeck:history_max_disk_bytes", "gauge", "Bytes the history folder may take.",
         [(label, live.store.bounds.max_bytes)])))


def _bearer(header: str) -> str:
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
