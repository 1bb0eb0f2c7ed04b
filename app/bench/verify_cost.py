"""`bench --verify-cost 1-9`: what one target forward of 1..N rows costs, after a prompt.

Why: speculation pays only while verifying k + 1 rows costs much less than k + 1 single-token
forwards. Where a backend's extra rows stop being nearly free (a CPU, an Apple GPU, a big
GPU) decides the k and the tree widths that pay there; this curve shows it on the user's own
machine.

Knows: the Model and Session protocols (start, forward with n_logits, rewind) and the clock;
rows are timed interleaved (1, 2, ..., N, then again) so drift spreads over every row count,
and each is the median of `rounds` timings after a warm-up round. Must not know: array
libraries (each backend's forward returns when its results are computed), drafters.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from app.core.types import SpecdeckError

PROMPT_TOKENS = 96  # the context the rows are verified after (less where the model is short)
ROUNDS = 5


def parse_rows(text: str) -> tuple[int, ...]:
    """"1-9" or "1,2,4,8": row counts, each at least 1."""
    try:
        if "-" in text:
            low, high = (int(part) for part in text.split("-", 1))
            rows = tuple(range(low, high + 1))
        else:
            rows = tuple(int(part) for part in text.split(","))
    except ValueError as error:
        raise SpecdeckError(f"--verify-cost takes a range like 1-9 or a list like 1,2,4 "
                            f"(got {text!r})") from error
    if not rows or min(rows) < 1:
        raise SpecdeckError(f"--verify-cost rows must be 1 or more (got {text!r})")
    return rows


def verify_costs(target: Any, rows: Sequence[int], rounds: int = ROUNDS) -> dict[str, Any]:
    """Median ms of one forward of n rows (n_logits n, as a verify asks) after a prompt, for
    each n in rows; `vs_one_row` divides each by the first count's."""
    vocab = max(int(target.vocab_size), 2)
    room = int(target.context_length) - max(rows) - 1
    if room < 1:
        raise SpecdeckError(f"--verify-cost: {target.name}'s context of "
                            f"{target.context_length} tokens cannot hold {max(rows)} rows")
    prompt = _tokens(min(PROMPT_TOKENS, room), vocab, offset=3)
    session = target.start()
    session.forward(prompt)
    base = session.length
    times: dict[int, list[float]] = {n: [] for n in rows}
    for round_ in range(rounds + 1):  # round 0 warms up
        for n in rows:
            start = time.perf_counter()
            session.forward(_tokens(n, vocab, offset=round_ + 5), n_logits=n)
            spent = 1000 * (time.perf_counter() - start)
            session.rewind(base)
            if round_:
                times[n].append(spent)
    medians = [statistics.median(times[n]) for n in rows]
    return {"rows": list(rows), "median_ms": [round(m, 3) for m in medians],
            "vs_one_row": [round(m / medians[0], 2) if medians[0] > 0 else None
                           for m in medians],
            "rounds": rounds, "prompt_tokens": len(prompt)}


def format_costs(costs: dict[str, Any]) -> str:
    """One line: "verify cost (ms by rows, after 96 tokens): 1: 3.10 (x1.00), 2: ..."."""
    cells = ", ".join(f"{n}: {ms:.2f} (x{ratio if ratio is not None else float('nan'):.2f})"
                      for n, ms, ratio in zip(costs["rows"], costs["median_ms"],
                                              costs["vs_one_row"], strict=True))
    return f"verify cost (ms by rows, after {costs['prompt_tokens']} tokens): {cells}"


def _tokens(n: int, vocab: int, offset: int) -> list[int]:
    # spread over the vocabulary, never the low ids where EOS and specials usually sit
    low = min(16, vocab - 1)
    return [low + (offset + 7 * i) % (vocab - low) for i in range(n)]
