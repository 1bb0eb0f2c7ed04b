"""OpenAI request bodies for `specdeck serve`: validation, unsupported fields, error objects.

Knows: the OpenAI chat and completions request shapes and error body, pydantic, what JSON a
body may hold (types are checked strictly, as OpenAI does: `"max_tokens": true` and
`"stream": "yes"` are refused, never coerced). Must not know: engines, threads or HTTP
frameworks.
"""

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_K = 32  # per-request k above this is refused: verify batches grow with k
SHOWN_CHARS = 80  # a refused value is echoed up to this length: bodies may be megabytes
# a JSON escape of a UTF-16 surrogate; only bodies holding one need the full string walk
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
STRICT = ConfigDict(strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class Part(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None


class OpenAIRequest(BaseModel):
    """Fields both endpoints share; unknown OpenAI fields are ignored, see _UNSUPPORTED."""

    model_config = ConfigDict(extra="allow", strict=True)
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
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    drafter: str | None = None  # a kind of app.drafters.CHOICES, checked when resolved
    k: int | None = Field(None, ge=0, le=MAX_K)
    # Ollama's: how long the named pair stays loaded after this request (installed-pairs mode)
    keep_alive: str | int | float | None = None


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(OpenAIRequest):
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
    "functions": lambda v: bool(v),  # the legacy name of tools
    "function_call": lambda v: v not in (None, "none"),
    "response_format": lambda v: bool(v) and (not isinstance(v, dict)
                                              or v.get("type", "text") != "text"),
}


class ApiError(Exception):
    """A refused request: an OpenAI error object with its status (4xx for bad requests)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def parse_request(model: type[OpenAIRequest], raw: bytes) -> OpenAIRequest:
    """The validated request, or ApiError naming the offending field."""
    data = _json(raw)
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
            raise ApiError(f"{name}={shown(data[name])} is not supported by specdeck serve",
                           name)
    return request


def shown(value: Any) -> str:
    """A value as an error message may quote it: repr (ASCII-safe for surrogates), cut short."""
    text = ascii(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _json(raw: bytes) -> Any:
    """The parsed body: strict JSON (no NaN or Infinity), no lone surrogates in any string."""
    try:
        data = json.loads(raw or b"null", parse_constant=_no_constant)
    except RecursionError as error:
        raise ApiError("the request body is nested too deeply") from error
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise ApiError(f"the request body is not valid JSON: {error}") from error
    if _SURROGATE_ESCAPE.search(raw or b"") and _has_lone_surrogate(data):
        raise ApiError("the request body holds a lone UTF-16 surrogate (like \\ud800), which "
                       "is not text: send valid Unicode")
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _has_lone_surrogate(data: Any) -> bool:
    """Any string (key or value) that UTF-8 cannot encode; iterative: bodies nest deeply."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


def _type_tag(part: str | int) -> bool:
    """Pydantic names the union member in an error's location (`str`, `list[int]`, `Part`)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                      or part.startswith("_"))
