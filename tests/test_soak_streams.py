"""Soak of batched streams (issue 47): 8 concurrent clients of one `specdeck serve --parallel 8`
for a set duration, mixed reply lengths, about 10% of requests leaving early (streams closed
mid-reply, whole replies given up), history off so only batching is soaked.

Claims: no server error and no unexpected client error; no stream's tokens in another's reply
(every completed reply's token ids equal its prompt's solo reply cut at its max_tokens); the
server's RSS after warm-up stays within 2%; /health answers 200 throughout.

Runs only when SPECDECK_SOAK_S (seconds of load after the warm-up) is set, marked `hours`:
`make soak-streams` (10 minutes on the default pair), or for hours
`SPECDECK_SOAK_S=21600 SPECDECK_SOAK_PAIR=qwen2.5-coder-1.5b+0.5b pytest -s -m hours`. Without
SPECDECK_SOAK_PAIR it soaks the tiny saved model.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.serving import save_tiny_model, serve_process
from tests.test_soak import (
    CAP_S,
    Ask,
    HealthWatch,
    Output,
    Planned,
    Tally,
    finished,
    idle,
    rss_mb,
    run_one,
    wait_until,
    whole,
)

pytestmark = pytest.mark.hours

DURATION_S = float(os.environ.get("SPECDECK_SOAK_S", "0"))
PAIR = os.environ.get("SPECDECK_SOAK_PAIR", "")
CLIENTS = 8
LEAVE_SHARE = 0.10
RSS_GROWTH_MAX = 0.02
WARM_UP_S = float(os.environ.get("SPECDECK_SOAK_WARM_S", "60"))
SEED = int(os.environ.get("SPECDECK_SOAK_SEED", "47"))
REAL_PROMPTS = ("Write a Python function that returns the n-th Fibonacci number.",
                "Explain what a hash map is in two sentences.",
                "def quicksort(xs):\n    \"\"\"Sort xs.\"\"\"\n",
                "List three uses of the Rust borrow checker.",
                "Write a SQL query that counts orders per customer.",
                "What does HTTP status 429 mean?",
                "Write a bash loop over every .txt file in a folder.",
                "Summarise the idea of speculative decoding in one sentence.")
TINY_PROMPTS = ("w5 w9 w12 w5 w9", "w20 w21 w22 w23", "w7 w7 w30 w41 w7 w7 w30",
                "w33 w2 w18 w44 w9 w10", "w3 w4 w3 w4 w3", "w11 w12 w13", "w40 w41 w40",
                "w8 w9 w10 w11 w12 w13")
LENGTHS = (16, 48, 96) if PAIR else (8, 16, 24)


@dataclass
class Clock:
    """The requests the clients sent, under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0

    def count(self) -> None:
        with self.lock:
            self.sent += 1


def asks() -> list[Ask]:
    prompts = REAL_PROMPTS if PAIR else TINY_PROMPTS
    return [Ask(chat, prompt, n) for chat in (False, True) for prompt in prompts
            for n in LENGTHS]


def solo_of(base_url: str) -> dict[Ask, Output]:
    """Each prompt's longest reply alone; a shorter ask's greedy reply is its prefix."""
    longest: dict[tuple[bool, str], Output] = {}
    with httpx.Client() as client:
        for ask in asks():
            if ask.max_tokens == max(LENGTHS):
                longest[(ask.chat, ask.prompt)] = whole(client, base_url, ask)
    solo = {}
    for ask in asks():
        full = longest[(ask.chat, ask.prompt)]
        cut = full.token_ids[:ask.max_tokens]
        solo[ask] = Output(cut, "", "length" if len(cut) == ask.max_tokens and (
            len(full.token_ids) > ask.max_tokens or full.finish_reason == "length")
            else full.finish_reason)
    return solo


def plan_one(rng: random.Random) -> Planned:
    ask, stream = rng.choice(asks()), rng.random() < 0.5
    if rng.random() >= LEAVE_SHARE:
        return Planned(ask, stream)
    if stream:
        return Planned(ask, stream, leave_after_chunks=rng.randint(0, ask.max_tokens))
    return Planned(ask, stream, leave_after_s=rng.uniform(0.0, 5.0))


def load(base_url: str, seconds: float, solo: dict[Ask, Output], tally, clock: Clock,
         seed: int) -> None:
    """CLIENTS threads asking one request after another until `seconds` have passed."""
    end = time.monotonic() + seconds

    def client_loop(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        with httpx.Client() as client:
            while time.monotonic() < end:
                clock.count()
                run_one(client, base_url, plan_one(rng), solo, tally)

    threads = [threading.Thread(target=client_loop, args=(i,), name=f"soak-client-{i}")
               for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + CAP_S)
        assert not thread.is_alive(), "a soak client never finished"


class IdsOnly:
    """Outputs compared by token ids and finish reason."""

    def __init__(self, output: Output) -> None:
        self.output = output

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Output) and (other.token_ids, other.finish_reason) == (
            self.output.token_ids, self.output.finish_reason)

    def __hash__(self) -> int:
        return hash(self.output.token_ids)

    def __repr__(self) -> str:
        return repr(self.output)


@pytest.mark.skipif(DURATION_S <= 0, reason="set SPECDECK_SOAK_S (seconds) to soak the streams")
def test_eight_clients_for_the_set_time_get_their_own_replies_and_leave_rss_flat(
        tmp_path: Path) -> None:
    model = ["--target", PAIR] if PAIR else ["--target", str(save_tiny_model(tmp_path / "tiny")),
                                           "--drafter", "ngram", "--k", "4"]
    log = tmp_path / "serve.log"
    args = [*model, "--parallel", str(CLIENTS), "--no-history", "--max-waiting", "64"]
    with serve_process(args, log, timeout=600) as (process, base_url):
        solo = {ask: IdsOnly(out) for ask, out in solo_of(base_url).items()}
        assert len({o.output.token_ids for o in solo.values()}) >= len(asks()) // 2, solo
        tally, clock = Tally(), Clock()
        started = time.monotonic()
        with HealthWatch(base_url) as health:
            load(base_url, WARM_UP_S, solo, tally, clock, SEED)
            wait_until(lambda: idle(base_url, clock.sent + len(asks()) // len(LENGTHS), tally),
                       "the warm-up finished on the server")
            warm_rss = rss_mb(process.pid)
            load(base_url, DURATION_S, solo, tally, clock, SEED + 1)
            wait_until(lambda: idle(base_url, clock.sent + len(asks()) // len(LENGTHS), tally),
                       "the soak finished on the server")
            end_rss = rss_mb(process.pid)
        wall_s = time.monotonic() - started
        reasons = finished(base_url)
    growth = (end_rss - warm_rss) / warm_rss
    report = (f"streams soak: {PAIR or 'tiny model'}, {CLIENTS} clients, {DURATION_S:.0f} s "
              f"after {WARM_UP_S:.0f} s warm-up ({wall_s:.0f} s in all): sent {clock.sent}, "
              f"completed {tally.completed}, left {tally.left}, errors {len(tally.errors)}, "
              f"mismatches {len(tally.mismatches)}; server finishes {dict(reasons)}; RSS warm "
              f"{warm_rss:.1f} MB -> end {end_rss:.1f} MB ({100 * growth:+.2f}%); "
              f"/health {dict(health.answers)}")
    print(report)
    assert not tally.errors, tally.errors[:10]
    assert not tally.mismatches, tally.mismatches[:10]
    assert tally.left > 0, "no client left early: the disconnect paths went untested"
    assert reasons.get("error", 0) == 0, report
    server_log = log.read_text()
    assert "Traceback" not in server_log, server_log[-3000:]
    assert set(health.answers) == {"200"}, health.answers
    assert abs(growth) <= RSS_GROWTH_MAX, report
