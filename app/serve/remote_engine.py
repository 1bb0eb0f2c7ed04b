"""Remote engine: drive an OpenAI-compatible server and report its runs like a local engine.

Knows: the OpenAI streaming wire format (SSE chunks, `usage`, error objects) and where each
engine exposes speculative statistics: specdeck's `speculative` object, llama-server's
`timings.draft_n` / `draft_n_accepted` (and its token ids, asked with `verbose`), vLLM's
`vllm:spec_decode_*` counters and SGLang's `sglang:spec_accept_*` gauges on /metrics. Must
not know: array libraries or the step loop; the server decodes, this adapter only turns its
stream into Step and Done events.

vLLM and SGLang count for the whole server: the adapter reads /metrics before and after each
request, so on a server shared with other clients the deltas include their tokens too.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.core.types import (
    Done,
    DrafterStats,
    RunStats,
    SamplingParams,
    SpecdeckError,
    Step,
    StopReason,
)
from app.serve import prometheus

ENGINES = ("auto", "specdeck", "vllm", "sglang", "llama.cpp", "openai")
OWNERS = {"specdeck": "specdeck", "vllm": "vllm", "sglang": "sglang", "llamacpp": "llama.cpp"}
Event = Step | Done
# the client times every stream itself; the rest of RunStats.to_dict() comes from the engine
MEASURED = frozenset({"n_new_tokens", "ttft_s", "decode_s", "decode_tok_s", "n_prompt_tokens",
                      "n_cached_prompt_tokens"})
_COUNTS = frozenset({"target_forwards", "drafted", "accepted", "acceptance_rate",
                     "mean_accepted_length"})
_POSITIONS = frozenset({"accepted_per_position", "drafted_per_position",
                        "acceptance_per_position"})
# which RunStats.to_dict() names each source of statistics fills (see the stats_from_* below)
REPORTS = {
    "specdeck": MEASURED | _COUNTS | _POSITIONS | {
        "accepted_length_histogram", "prefill_s", "draft_s", "verify_s", "other_s",
        "drafters"},
    "llama.cpp": MEASURED | _COUNTS | {"prefill_s"},
    "vllm": MEASURED | _COUNTS | _POSITIONS,
    "sglang": MEASURED | _COUNTS,
    "none": MEASURED,
}


@dataclass(frozen=True)
class RemoteTarget:
    """What the UI reads off engine.target; the server owns the model and its tokenizer."""

    name: str
    context_length: int = 0
    device: str = "remote"
    dtype: str = "?"
    tokenizer: Any = None
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class SpecCounters:
    """Engine-wide speculative counters at one moment (vLLM counters, SGLang gauges)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()
    verify_calls: float | None = None  # SGLang's spec_verify_calls_total, where it exists
    accept_length: float | None = None  # SGLang gauge: τ of the last logging interval
    accept_rate: float | None = None  # SGLang gauge: accepted / drafted, same interval


def vllm_counters(samples: Sequence[prometheus.Sample], prefix: str = "vllm:") -> SpecCounters:
    """vLLM's spec_decode_* counters (specdeck serve writes the same names under specdeck:)."""
    def count(name: str) -> float:
        return prometheus.total(samples, f"{prefix}spec_decode_{name}_total") or 0.0
    per_pos = prometheus.by_label(samples, f"{prefix}spec_decode_num_accepted_tokens_per_pos_total",
                                  "position")
    return SpecCounters(drafts=count("num_drafts"), draft_tokens=count("num_draft_tokens"),
                        accepted=count("num_accepted_tokens"),
                        accepted_per_pos=tuple(per_pos[p] for p in sorted(per_pos, key=int)))


def sglang_counters(samples: Sequence[prometheus.Sample]) -> SpecCounters:
    """SGLang's spec_accept_length / spec_accept_rate gauges and verify-call counter."""
    # every tensor-parallel rank repeats the same numbers: count rank 0 only
    samples = [s for s in samples if s.label("tp_rank") in (None, "0")]
    return SpecCounters(verify_calls=prometheus.total(samples, "sglang:spec_verify_calls_total"),
                        accept_length=prometheus.mean(samples, "sglang:spec_accept_length"),
                        accept_rate=prometheus.mean(samples, "sglang:spec_accept_rate"))


def stats_from_vllm(before: SpecCounters, after: SpecCounters, n_new: int) -> dict[str, Any]:
    """RunStats fields from the counter deltas around one request."""
    drafts = round(after.drafts - before.drafts)
    drafted = round(after.draft_tokens - before.draft_tokens)
    accepted = round(after.accepted - before.accepted)
    per_pos = tuple(round(a - (before.accepted_per_pos[j] if j < len(before.accepted_per_pos)
                                else 0.0)) for j, a in enumerate(after.accepted_per_pos))
    k = round(drafted / drafts) if drafts else 0  # vLLM drafts a fixed k per step
    return {"drafted": drafted, "accepted": accepted, "accepted_per_position": per_pos,
            "drafted_per_position": (drafts,) * k,
            "target_forwards": _forwards(n_new, accepted)}


def stats_from_sglang(before: SpecCounters, after: SpecCounters, n_new: int) -> dict[str, Any]:
    """RunStats fields from SGLang: exact forwards when the verify counter exists, else τ."""
    decoded = max(n_new - 1, 0)
    if after.verify_calls is not None and before.verify_calls is not None:
        forwards = round(after.verify_calls - before.verify_calls)
    elif after.accept_length:
        forwards = round(decoded / after.accept_length)
    else:
        return {}
    forwards = min(max(forwards, 0), decoded)
    accepted = decoded - forwards
    rate = after.accept_rate
    drafted = round(accepted / rate) if rate else 0
    return {"target_forwards": forwards, "accepted": accepted, "drafted": max(drafted, accepted)}


def stats_from_llama(timings: Mapping[str, Any]) -> dict[str, Any]:
    """RunStats fields from llama-server's per-request `timings`."""
    n_new = int(timings.get("predicted_n") or 0)
    accepted = int(timings.get("draft_n_accepted") or 0)
    cached = int(timings.get("cache_n") or 0)
    return {"drafted": int(timings.get("draft_n") or 0), "accepted": accepted,
            "n_new_tokens": n_new, "target_forwards": _forwards(n_new, accepted),
            "n_prompt_tokens": int(timings.get("prompt_n") or 0) + cached,
            "n_cached_prompt_tokens": cached,
            "prefill_s": float(timings.get("prompt_ms") or 0.0) / 1000,
            "decode_s": float(timings.get("predicted_ms") or 0.0) / 1000}


def stats_from_specdeck(spec: Mapping[str, Any]) -> dict[str, Any]:
    """RunStats fields from specdeck serve's `speculative` object (app/serve/server.py)."""
    return {"drafted": spec["num_draft_tokens"], "accepted": spec["num_accepted_draft_tokens"],
            "target_forwards": spec["num_spec_steps"],
            "accepted_per_position": tuple(spec["accepted_per_position"]),
            "drafted_per_position": tuple(spec["drafted_per_position"]),
            "accepted_length_histogram": tuple(spec["acceptance_histogram"]),
            **{key: spec[key] for key in ("ttft_s", "prefill_s", "decode_s", "draft_s",
                                          "verify_s")},
            "drafters": tuple(DrafterStats(d["name"], d["steps"], d["drafted"], d["accepted"])
                              for d in spec.get("drafters", ()))}


def _forwards(n_new: int, accepted: int) -> int:
    # every verify forward commits its accepted drafts plus one target token
    return max(n_new - 1 - accepted, 0)


@dataclass
class _Progress:
    """What one streamed request has delivered so far."""

    start: float
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    flags: list[bool] = field(default_factory=list)
    n_chunks: int = 0
    first_at: float = 0.0
    last_at: float = 0.0
    finish: str | None = None
    stop: Any = None
    final: dict[str, Any] = field(default_factory=dict)  # usage, speculative, timings

    def add(self, chunk: Mapping[str, Any]) -> Step | None:
        for key in ("usage", "speculative", "timings"):
            if chunk.get(key):
                self.final[key] = chunk[key]
        choices = chunk.get("choices") or []
        if not choices:
            return None
        choice = choices[0]
        self.finish = choice.get("finish_reason") or self.finish
        self.stop = choice.get("stop_reason", self.stop)
        delta = choice.get("delta") or {}
        text = delta.get("content") if "delta" in choice else choice.get("text")
        # llama-server's OpenAI chunks carry no token ids; its per-request `verbose` adds
        # them in __verbose.tokens. It streams no chunk for a token that ends inside a UTF-8
        # character, so such a token is missing here; usage still counts it
        ids = [int(t) for t in choice.get("token_ids") or
               (chunk.get("__verbose") or {}).get("tokens") or []]
        flags = [bool(f) for f in choice.get("from_draft") or [False] * len(ids)]
        if not text and not ids:
            return None
        now = time.perf_counter()
        self.first_at = self.first_at or now
        self.last_at = now
        self.n_chunks += 1
        self.text.append(text or "")
        self.ids.extend(ids)
        self.flags.extend(flags)
        stats = RunStats(n_new_tokens=len(self.ids) or self.n_chunks,
                         ttft_s=self.first_at - self.start, decode_s=now - self.first_at)
        return Step(tokens=tuple(ids), from_draft=tuple(flags), text=text or "", n_drafted=0,
                    n_accepted=sum(flags), stats=stats)

    def stop_reason(self) -> StopReason:
        if self.finish == "length":
            return "length"
        if self.finish in ("abort", "cancelled"):
            return "cancelled"
        return "stop_string" if isinstance(self.stop, str) else "eos"


class RemoteEngine:
    """An engine-shaped client of an OpenAI-compatible server: generate() and chat() yield
    Step events and one Done, with RunStats filled from the engine's own statistics."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 engine: str = "auto", drafter: str | None = None, k: int | None = None,
                 timeout: float = 600.0, transport: httpx.BaseTransport | None = None,
                 extra: Mapping[str, Any] | None = None) -> None:
        if engine not in ENGINES:
            raise SpecdeckError(f"unknown engine {engine!r}: use {', '.join(ENGINES)}")
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.root = self.base_url.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, transport=transport,
                                  timeout=httpx.Timeout(timeout, connect=10.0))
        self.lock = threading.Lock()  # callers serialise, as with SpecEngine
        self.extra = dict(extra or {})  # fields every request carries: an engine's own options
        try:
            card = self._card(model)
            self.kind = engine if engine != "auto" else self._detect(card)
        except SpecdeckError:
            self._http.close()
            raise
        own = card.get("specdeck") or {}
        self.target = RemoteTarget(name=card["id"],
                                   context_length=int(card.get("max_model_len") or 0),
                                   dtype=str(own.get("dtype", "?")))
        self.drafter_name = drafter or own.get("drafter") or self.kind
        self._server_k = own.get("k", 0)
        self._drafter = drafter  # specdeck serve only: a per-request drafter
        # like SpecEngine.k: settable between generations ("auto" where the server adapts k)
        self.k: int | str = k if k is not None else self._server_k
        # the RunStats names the last run's engine reported; callers show the rest as unknown
        self.reported: frozenset[str] = REPORTS["none"]

    def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """A completion of prompt text (or token ids) through /v1/completions."""
        body = {"prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt]}
        return self._stream("/completions", body, params, cancel)

    def chat(self, messages: Sequence[Mapping[str, str]], params: SamplingParams,
             cancel: threading.Event | None = None) -> Iterator[Event]:
        """A chat reply through /v1/chat/completions; the server applies its chat template."""
        return self._stream("/chat/completions", {"messages": list(messages)}, params, cancel)

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """The server checks prompt length; refuse only what is empty."""
        if not prompt_ids:
            raise SpecdeckError("the prompt is empty: give some text to continue")

    def close(self) -> None:
        self._http.close()

    def _stream(self, path: str, body: dict[str, Any], params: SamplingParams,
                cancel: threading.Event | None) -> Iterator[Event]:
        body = {**body, **self._sampling(params), "model": self.target.name, "stream": True,
                "stream_options": {"include_usage": True}}
        before = self._counters()
        progress = _Progress(start=time.perf_counter())
        reason: StopReason | None = None
        try:
            with self._http.stream("POST", self.base_url + path, json=body) as response:
                _raise_for_status(response)
                for chunk in _sse(response.iter_lines()):
                    if cancel is not None and cancel.is_set():
                        reason = "cancelled"
                        break
                    step = progress.add(chunk)
                    if step is not None:
                        yield step
        except (httpx.HTTPError, _StreamError) as error:
            yield Done(text="".join(progress.text), token_ids=tuple(progress.ids),
                       stop_reason="error", stats=self._stats(progress, None, None),
                       error=f"{self.base_url}: {error}", from_draft=tuple(progress.flags))
            return
        unfinished = reason is None and progress.finish is None
        after = self._counters() if reason is None else None
        yield Done(text="".join(progress.text), token_ids=tuple(progress.ids),
                   stop_reason="error" if unfinished else reason or progress.stop_reason(),
                   stats=self._stats(progress, before, after), from_draft=tuple(progress.flags),
                   error=f"{self.base_url}: the stream ended early" if unfinished else None)

    def _sampling(self, params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                                "max_tokens": params.max_new_tokens}
        if self.kind == "specdeck":  # per-request drafter and k are specdeck's own fields
            body |= {"drafter": self._drafter} if self._drafter else {}
            body |= {"k": self.k} if self.k != self._server_k else {}
        if self.kind == "llama.cpp":
            body["verbose"] = True  # the only way its OpenAI stream names the token ids
        optional = {"seed": params.seed, "stop": list(params.stop) or None,
                    "top_k": params.top_k or None, "min_p": params.min_p or None}
        return (body | {key: value for key, value in optional.items() if value is not None}
                | self.extra)

    def _stats(self, progress: _Progress, before: SpecCounters | None,
               after: SpecCounters | None) -> RunStats:
        usage = progress.final.get("usage") or {}
        n_new = int(usage.get("completion_tokens") or len(progress.ids) or progress.n_chunks)
        fields: dict[str, Any] = {
            "n_prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "n_cached_prompt_tokens": int((usage.get("prompt_tokens_details") or {})
                                          .get("cached_tokens") or 0),
            "n_new_tokens": n_new, "ttft_s": progress.first_at - progress.start if
            progress.first_at else 0.0, "decode_s": progress.last_at - progress.first_at,
            "target_forwards": max(n_new - 1, 0)}
        source, spec = self._spec_fields(progress, before, after, n_new)
        self.reported = REPORTS[source] if spec else REPORTS["none"]
        return RunStats(**fields | spec)

    def _spec_fields(self, progress: _Progress, before: SpecCounters | None,
                     after: SpecCounters | None, n_new: int) -> tuple[str, dict[str, Any]]:
        """(source, RunStats fields) from whichever statistics this engine reported."""
        if "speculative" in progress.final:
            return "specdeck", stats_from_specdeck(progress.final["speculative"])
        if "timings" in progress.final:
            return "llama.cpp", stats_from_llama(progress.final["timings"])
        if before is not None and after is not None and self.kind == "vllm":
            return "vllm", stats_from_vllm(before, after, n_new)
        if before is not None and after is not None and self.kind == "sglang":
            return "sglang", stats_from_sglang(before, after, n_new)
        return "none", {}

    def _counters(self) -> SpecCounters | None:
        if self.kind not in ("vllm", "sglang"):
            return None
        text = self._metrics_text()
        if text is None:
            return None
        samples = prometheus.parse(text)
        return vllm_counters(samples) if self.kind == "vllm" else sglang_counters(samples)

    def _metrics_text(self) -> str | None:
        try:
            response = self._http.get(self.root + "/metrics")
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    def _card(self, model: str | None) -> dict[str, Any]:
        try:
            response = self._http.get(self.base_url + "/models")
        except httpx.HTTPError as error:
            raise SpecdeckError(f"cannot reach {self.base_url}: {error}. Is the server "
                                "running, and is the URL right (http://HOST:PORT/v1)?") from error
        _raise_for_status(response)
        try:
            cards = response.json().get("data") or []
        except (ValueError, AttributeError) as error:
            raise SpecdeckError(f"{self.base_url}/models did not answer like an "
                                "OpenAI-compatible server") from error
        if not cards:
            raise SpecdeckError(f"{self.base_url} serves no model")
        if model is None:
            return cards[0]
        for card in cards:
            if card.get("id") == model:
                return card
        names = ", ".join(str(c.get("id")) for c in cards)
        raise SpecdeckError(f"{self.base_url} does not serve {model!r}; it serves: {names}")

    def _detect(self, card: Mapping[str, Any]) -> str:
        if "specdeck" in card:
            return "specdeck"
        owner = OWNERS.get(str(card.get("owned_by", "")))
        if owner is not None:
            return owner
        text = self._metrics_text() or ""
        return "vllm" if "vllm:" in text else "sglang" if "sglang:" in text else "openai"


def connect(base_url: str, **options: Any) -> RemoteEngine:
    """A RemoteEngine for the server at base_url (http://HOST:PORT or .../v1)."""
    return RemoteEngine(base_url, **options)


FIXES = {401: " (give the server's key with --api-key KEY or $SPECDECK_API_KEY)",
         403: " (give the server's key with --api-key KEY or $SPECDECK_API_KEY)",
         404: " (is the URL the server's API root, http://HOST:PORT/v1?)"}


class _StreamError(Exception):
    """The server reported an error inside the stream."""


def _sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """JSON payloads of `data:` lines until [DONE]; error payloads raise _StreamError."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError as error:
            raise _StreamError(f"unreadable stream chunk {payload[:80]!r}") from error
        if isinstance(chunk, dict) and chunk.get("error"):
            raise _StreamError(_message(chunk))
        yield chunk


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    response.read()
    try:
        message = _message(response.json())
    except (json.JSONDecodeError, ValueError):
        message = response.text[:200]
    fix = FIXES.get(response.status_code, "")
    raise SpecdeckError(f"{response.url} refused the request ({response.status_code}): "
                        f"{message}{fix}")


def _message(body: Any) -> str:
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
