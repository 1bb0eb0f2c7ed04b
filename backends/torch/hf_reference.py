"""HF transformers' own generation, run beside specdeck's so a bench compares side by side.

Knows: transformers' generate() for plain greedy decoding, assisted generation
(assistant_model, HF's default schedule) and prompt lookup (prompt_lookup_num_tokens), and
how to time them with a streamer. Must not know: specdeck's engine or the bench's statistics.
Imports torch: app/bench/run.py loads it only under --compare-hf, on the torch backend.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import logging as hf_logging
from transformers.generation.streamers import BaseStreamer

from app.core.types import SpecdeckError

METHODS = ("hf-plain", "hf-assisted", "hf-prompt-lookup")
PROMPT_LOOKUP_TOKENS = 10  # the value HF's documentation and the measurements use


@dataclass(frozen=True)
class HfRun:
    """One greedy generate() call: its new tokens and when they arrived."""

    token_ids: tuple[int, ...]
    total_s: float  # the whole call, prefill included
    first_s: float  # until the first new tokens were committed (prefill included)
    n_first: int  # tokens committed with that first commit (1 for plain, more when assisted)

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first commit: specdeck's decode_tok_s definition."""
        decoded = len(self.token_ids) - self.n_first
        span = self.total_s - self.first_s
        return decoded / span if decoded > 0 and span > 0 else 0.0


class _Clock(BaseStreamer):
    """Records when generate() commits its first new tokens; the first put is the prompt."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_at = 0.0
        self.n_first = 0

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_at = time.perf_counter()
            self.n_first = int(value.numel())

    def end(self) -> None:
        return None


def generate(method: str, target: Any, prompt_ids: Sequence[int], max_new_tokens: int,
             draft: Any = None) -> HfRun:
    """Run one greedy generation of `method` on TorchModel target (draft for hf-assisted)."""
    if method not in METHODS:
        raise SpecdeckError(f"unknown HF method {method!r}: use one of {', '.join(METHODS)}")
    if method == "hf-assisted" and draft is None:
        raise SpecdeckError("HF assisted generation needs a draft model: give --draft or --pair")
    extra: dict[str, Any] = {}
    if method == "hf-assisted":
        extra["assistant_model"] = draft.hf
    elif method == "hf-prompt-lookup":
        extra["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    eos = sorted(target.eos_token_ids)
    clock = _Clock()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the checkpoint's sampling defaults warn under greedy
    models = [m for m in (target, draft) if m is not None]
    ours = [m.hf.config._attn_implementation for m in models]
    try:
        _as_hf_ships(models)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.hf.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                do_sample=False, repetition_penalty=1.0, eos_token_id=eos,
                pad_token_id=eos[0] if eos else None, streamer=clock, **extra)
        total = time.perf_counter() - start
    finally:
        for model, attention in zip(models, ours):
            model.hf.set_attn_implementation(attention)
        hf_logging.set_verbosity(verbosity)
    new = tuple(int(t) for t in out[0, ids.shape[1]:].tolist())
    first = clock.first_at - start if clock.puts >= 2 else total
    return HfRun(token_ids=new, total_s=total, first_s=first, n_first=clock.n_first or len(new))


def _as_hf_ships(models: list[Any]) -> None:
    """HF's own attention, so HF runs as a user would get it (the output layers are the
    models' own: drafters keep their vocabulary subsets and 4-bit heads in their sessions)."""
    for model in models:
        model.hf.set_attn_implementation("sdpa")
