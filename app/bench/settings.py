"""What one bench run does: its settings, the names of the configurations every surface shares.

Knows: nothing but its values. Must not know: models, engines or the command line.
"""

from __future__ import annotations

from dataclasses import dataclass

WARMUP_TOKENS = 16  # enough steps to touch every code path and size the caches
LLAMA_PLAIN = "llama.cpp plain"  # app/bench/llamacpp.py's plain configuration


@dataclass(frozen=True)
class BenchSettings:
    """What one bench run does; `chat` None means on when the tokenizer has a chat template."""

    drafters: tuple[str, ...] = ("ngram",)
    ks: tuple[int | str, ...] = (4,)
    max_new_tokens: int = 128
    repeats: int = 1
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1
    chat: bool | None = None
    compare_hf: bool = False
    draft_vocab: int = 0  # 0 = the draft model's whole vocabulary
    head: str | None = None  # the head folder of eagle3 / eagle configurations
    auto_kind: str | None = None  # what "auto" runs: the planner's choice for the target
    verify_rows: tuple[int, ...] = ()  # time the target's verify of these row counts too
