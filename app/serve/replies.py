"""What a run's events become on the wire: OpenAI chat and completion objects, their SSE chunks,
the `speculative` object (vLLM's per-request stat names where they exist) and usage.

Knows: the OpenAI response shapes, RunStats, stop rules.
Must not know: sockets, threads (it awaits the relay's events) or how the engine is loaded.
"""

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from app.core.types import Done, RunStats, SamplingParams, Step
from app.serve.jobs import Job, Served
from app.serve.metrics import FINISH
from app.serve.relay import Run
from app.serve.requests import ApiError, error_body


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
