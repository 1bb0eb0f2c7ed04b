"""What a bench run times: a configuration (plain, a drafter at a k, another engine) and one
timed generation of it on one prompt.

Knows: the record's fields. Must not know: how a configuration runs (a leaf: the engine's,
llama-server's and a remote engine's runners all produce these records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Config:
    name: str  # "plain", "ngram k=4", "draft k=auto", "hf-assisted"
    drafter: str  # none, ngram, draft, hf-plain, hf-assisted, hf-prompt-lookup
    k: int | str


@dataclass(frozen=True)
class Record:
    """One timed generation of one configuration on one prompt."""

    config: str
    prompt_id: str
    category: str
    repeat: int
    token_ids: tuple[int, ...]
    decode_tok_s: float
    decode_s: float
    decoded: int  # tokens after the first commit: the numerator of decode_tok_s
    total_s: float
    stats: dict[str, Any] | None  # RunStats.to_dict() for specdeck runs, None for HF's
    error: str | None = None
    n_new: int | None = None  # tokens generated, where token_ids may miss some (llama-server)

    @property
    def e2e_tok_s(self) -> float:
        n = len(self.token_ids) if self.n_new is None else self.n_new
        return n / self.total_s if self.total_s > 0 else 0.0
