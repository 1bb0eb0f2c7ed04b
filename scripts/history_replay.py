"""The history workload over HTTP: specdeck with its history against specdeck plain, in order.

Usage: history_replay.py HISTORY_URL PLAIN_URL OUT.json [--max-tokens N] [--repeats N]
                         [--no-history-url URL] [--engine NAME=URL ...]

HISTORY_URL is a `specdeck serve` with history on (its own SPECDECK_HISTORY), asked with its
defaults; PLAIN_URL a second one started with --no-history, asked with `"drafter": "none"`
(plain) and with its defaults (today's speculation, without history). --no-history-url sends
the latter to a third server (also --no-history): a server asked the same messages twice in a
row finds the prompt cached the second time, which shortens that request's wall time, so
every configuration needs its own server for the times to compare. The records of
assets/prompts/history.jsonl are replayed in their order,
as a user would send them, so the history warms as in use: a second turn goes with the
model's own first reply as the assistant message. Each request goes to every configuration in turn
(the order alternating), greedy; speed is completion tokens over the request's wall time, and
specdeck's replies must be the same text. --engine NAME=URL adds another server asked with its
own defaults in the same rotation (llama-server plain, `--spec-type ngram-mod`, `ngram-cache`);
its replies are compared with its own first engine's (other kernels than specdeck's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

WORKLOAD = Path(__file__).resolve().parents[1] / "assets/prompts/history.jsonl"


def ask(client: httpx.Client, base: str, messages: list[dict], max_tokens: int,
        drafter: str | None) -> tuple[str, int, float]:
    body = {"messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": False}
    if drafter:
        body["drafter"] = drafter
    start = time.perf_counter()
    reply = client.post(f"{base}/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - start
    reply.raise_for_status()
    data = reply.json()
    return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"], seconds


def replay(history: str, plain: str, max_tokens: int, repeats: int,
           engines: dict[str, str] | None = None, no_history: str | None = None) -> list[dict]:
    records = [json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.strip()]
    rows, flip = [], False
    with httpx.Client() as client:
        for round_ in range(repeats):
            for record in records:
                messages: list[dict] = []
                for turn, text in enumerate(record["turns"]):
                    messages.append({"role": "user", "content": text})
                    order = [("history", history, None), ("plain", plain, "none"),
                             ("no_history", no_history or plain, None),
                             *((name, url, None) for name, url in (engines or {}).items())]
                    got = {}
                    for name, base, drafter in (order[::-1] if flip else order):
                        got[name] = ask(client, base, messages, max_tokens, drafter)
                    flip = not flip
                    rows.append({"id": record["id"], "category": record["category"],
                                 "round": round_, "turn": turn + 1,
                                 "history_tok_s": got["history"][1] / got["history"][2],
                                 "plain_tok_s": got["plain"][1] / got["plain"][2],
                                 "no_history_tok_s": got["no_history"][1] / got["no_history"][2],
                                 "same": got["history"][0] == got["plain"][0]
                                 == got["no_history"][0],
                                 **{f"{name}_tok_s": got[name][1] / got[name][2]
                                    for name in engines or {}},
                                 "engines_same": len({got[name][0] for name in engines or {}})
                                 <= 1})
                    print(json.dumps(rows[-1]), flush=True)
                    messages.append({"role": "assistant", "content": got["plain"][0]})
    return rows


def summarise(rows: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for category in sorted({r["category"] for r in rows}) + ["all"]:
        mine = [r for r in rows if category in ("all", r["category"])]
        out[category] = {
            "history_tok_s": statistics.median(r["history_tok_s"] for r in mine),
            "plain_tok_s": statistics.median(r["plain_tok_s"] for r in mine),
            "no_history_tok_s": statistics.median(r["no_history_tok_s"] for r in mine),
            "ratio": statistics.median(r["history_tok_s"] / r["plain_tok_s"] for r in mine),
            "no_history_ratio": statistics.median(r["no_history_tok_s"] / r["plain_tok_s"]
                                                  for r in mine),
            **{key: statistics.median(r[key] for r in mine) for key in mine[0]
               if key.endswith("_tok_s") and key not in ("history_tok_s", "plain_tok_s",
                                                         "no_history_tok_s")},
            "all_same": all(r["same"] for r in mine), "requests": len(mine)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("history", help="the /v1 URL of a specdeck serve with history on")
    parser.add_argument("plain", help="the /v1 URL of a specdeck serve --no-history")
    parser.add_argument("out", help="JSON file for the rows and medians")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the workload")
    parser.add_argument("--no-history-url", help="a third specdeck serve --no-history for "
                        "its defaults, so no request finds its prompt cached by the one before")
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=URL",
                        help="another server in the rotation, asked with its defaults")
    args = parser.parse_args()
    engines = dict(item.split("=", 1) for item in args.engine)
    rows = replay(args.history, args.plain, args.max_tokens, args.repeats, engines,
                  args.no_history_url)
    summary = summarise(rows)
    Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
