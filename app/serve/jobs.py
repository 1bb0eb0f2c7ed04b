"""A request made ready to run: the served engine, the prompt's ids (chat template or raw
completion), the sampling values and the job the relay runs.

Knows: the OpenAI request values (app/serve/requests.py) and a SpecEngine's tokenizer and context;
the API keys and the history partition each one's requests record into and draft from.
Must not know: HTTP, threads or the reply shapes.
"""

import hmac
from dataclasses import dataclass, field, replace
from typing import Any

from app import drafters
from app.core.engine import LOCAL_PARTITION
from app.core.types import SamplingParams, SpecdeckError
from app.drafters.kinds import unknown
from app.drafters.suffix import for_partition
from app.flags import DEFAULT_K
from app.runtime import compute
from app.serve.admission import Gate
from app.serve.metrics import Metrics
from app.serve.pool import Pool
from app.serve.requests import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Message,
    OpenAIRequest,
    parse_request,
    shown,
)

# a request without max_tokens gets this many (or the context left, when that is fewer):
# vLLM's default, the whole context, lets one forgotten field hold the engine for minutes
DEFAULT_MAX_TOKENS = 2048
DEFAULT_MAX_BODY_MB = 4.0  # a full 128k-token prompt, as text or token ids, is about 1 MB
DEFAULT_MAX_WAITING = 16
# a text this many times the context in characters is checked on a prefix first: tokenizing
# all of a 20 MB prompt took 19 s only to refuse it
PREFIX_CHARS_PER_TOKEN = 16


@dataclass
class Served:
    """One loaded engine and what the server says about it."""

    engine: Any
    model_id: str
    drafter_name: str
    backend_name: str = "?"
    default_k: int | str = DEFAULT_K
    api_key: str | None = None
    api_keys: tuple[str, ...] = ()  # more keys (serve --api-key repeated, --api-keys-file)
    metrics: "Metrics" = field(default_factory=lambda: Metrics())
    gate: Gate = field(default_factory=lambda: Gate(DEFAULT_MAX_WAITING))
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)

    streams: Any = None  # app/runtime/streams.Streams: the slots every request steps in
    # the opened pair (app/pair.py): what a request's drafter is checked against and built
    # from, once per kind; without one (a scripted engine), the engine's target alone
    pair: Any = None
    # serving the installed pairs: each pair's counters, kept across its unloads
    pair_metrics: dict[str, Metrics] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pair is None and self.engine is not None:  # a front (installed pairs) has none
            from app.pair import Pair
            self.pair = Pair(None, self.engine.target,
                             history=getattr(self.engine, "recorder", None))

    def keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*((self.api_key,) if self.api_key else ()), *self.api_keys)))

    def partition_of(self, token: str) -> str | None:
        """The history partition of a bearer token: its key's (history.partition_of), the
        local one when the server takes no keys, None for a wrong token."""
        from app.store.history import partition_of

        keys = self.keys()
        if not keys:
            return LOCAL_PARTITION
        # every key compared, in constant time each: which one matched is not timed
        matched = [key for key in keys if hmac.compare_digest(token.encode(), key.encode())]
        return partition_of(matched[0]) if matched else None

    def drafter_for(self, name: str | None) -> tuple[Any, str]:
        """The drafter a request asks for; ApiError when this server cannot run it."""
        name = name or self.drafter_name
        if name == self.drafter_name:
            return self.engine.drafter, name
        pair = self.pair
        refusal = pair.check(name) if name in drafters.KINDS else unknown(name)  # no ":tree"
        if refusal is not None:
            raise ApiError(refusal.message, "drafter")
        return pair.drafter(name), name

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
    partition: str = LOCAL_PARTITION  # whose history it records into and drafts from

    def for_partition(self, partition: str) -> "Job":
        if partition == self.partition:
            return self
        return replace(self, partition=partition, drafter=for_partition(self.drafter, partition))


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
