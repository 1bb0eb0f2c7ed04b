"""Plain against default settings (and llama-server) over HTTP, interleaved, per prompt set.

Usage: http_race.py SPECDECK_URL OUT.json [--limit N] [--max-tokens N] [--llama URL]
                    [--sets chat,spec-bench:rag,...]

Each prompt is asked three ways in turn (specdeck with `"drafter": "none"`, specdeck with
its defaults, llama-server), each after a short other request, so no reply reuses the last
one's prompt cache; the order alternates between prompts so drift does not favour one side.
Speed is completion tokens over the request's wall time, prefill included: what a client waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from app.bench.prompts import load_prompts  # noqa: E402

SPEC_BENCH = ("mt_bench", "translation", "summarization", "qa", "rag")
SHOWN = ("drafter", "k", "draft_acceptance_rate", "num_draft_tokens")  # on each printed line


def prompt_sets(limit: int, only: str = "") -> dict[str, list]:
    """Every set (or those named in only, comma-separated), limit prompts each."""
    sets = {"chat": load_prompts("mt-bench", limit=1)[:limit],
            "code": load_prompts("humaneval", limit=limit),
            "math": load_prompts("spec-bench:math_reasoning", limit=limit)}
    for category in SPEC_BENCH:
        sets[f"spec-bench:{category}"] = load_prompts(f"spec-bench:{category}",
                                                      limit=max(1, limit - 1))
    names = [name for name in only.split(",") if name]
    unknown = sorted(set(names) - set(sets))
    if unknown:
        raise SystemExit(f"unknown sets {unknown}: choose from {sorted(sets)}")
    return {name: sets[name] for name in names} if names else sets


class Asker:
    def __init__(self, max_tokens: int) -> None:
        self.client = httpx.Client(timeout=600)
        self.max_tokens = max_tokens

    def wait_for(self, base: str) -> None:
        for _ in range(600):
            try:
                self.client.get(f"{base}/models").raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(1)
        raise SystemExit(f"{base} never answered")

    def ask(self, base: str, text: str, drafter: str | None) -> dict:
        self._post(base, "Name a colour.", 1, None)  # the next prompt finds no cached prefix
        start = time.perf_counter()
        data = self._post(base, text, self.max_tokens, drafter)
        wall = time.perf_counter() - start
        tokens = data["usage"]["completion_tokens"]
        return {"tok_s": tokens / wall, "tokens": tokens, "spec": data.get("speculative") or {},
                "text": data["choices"][0]["message"]["content"]}

    def _post(self, base: str, text: str, max_tokens: int, drafter: str | None) -> dict:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0}
        if drafter:
            body["drafter"] = drafter
        response = self.client.post(f"{base}/chat/completions", json=body)
        response.raise_for_status()
        return response.json()


def race(asker: Asker, url: str, llama: str | None, sets: dict[str, list]) -> list[dict]:
    ways = [("plain", url, "none"), ("default", url, None)]
    if llama:
        ways.append(("llama", llama, None))
    rows = []
    for n, (name, prompt) in enumerate((s, p) for s, ps in sets.items() for p in ps):
        order = ways if n % 2 == 0 else ways[::-1]
        got = {label: asker.ask(base, prompt.text, drafter) for label, base, drafter in order}
        rows.append(row_of(name, prompt.id, got))
        print(line_of(rows[-1]), flush=True)
    return rows


def row_of(name: str, prompt_id: str, got: dict) -> dict:
    plain, default = got["plain"], got["default"]
    row = {"set": name, "id": prompt_id, "plain_tok_s": plain["tok_s"],
           "default_tok_s": default["tok_s"], "ratio": default["tok_s"] / plain["tok_s"],
           "same": plain["text"] == default["text"], "tokens": default["tokens"],
           "spec": {k: v for k, v in default["spec"].items() if k in SHOWN},
           # the timings and each drafter's share, to see where a slower reply lost its time
           "plain_detail": plain["spec"], "default_detail": default["spec"]}
    if "llama" in got:
        llama = got["llama"]["tok_s"]
        row.update(llama_tok_s=llama, vs_llama=default["tok_s"] / llama,
                   plain_vs_llama=plain["tok_s"] / llama)
    return row


def line_of(row: dict) -> str:
    text = (f"{row['set']:24s} {row['id']:>8s} plain {row['plain_tok_s']:6.2f} default "
            f"{row['default_tok_s']:6.2f} tok/s {row['ratio']:.2f}x same={row['same']}")
    if "llama_tok_s" in row:
        text += f" llama {row['llama_tok_s']:6.2f} default/llama {row['vs_llama']:.2f}x"
    return text + " " + json.dumps(row["spec"])


def summarise(rows: list[dict]) -> dict[str, dict[str, float]]:
    summary = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        mine = [r for r in rows if r["set"] == name]
        medians = {"default/plain": statistics.median(r["ratio"] for r in mine), "n": len(mine)}
        if "vs_llama" in mine[0]:
            medians["default/llama"] = statistics.median(r["vs_llama"] for r in mine)
            medians["plain/llama"] = statistics.median(r["plain_vs_llama"] for r in mine)
        summary[name] = medians
        print(f"MEDIAN {name:24s} " + "  ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="specdeck serve's /v1 URL")
    parser.add_argument("out", help="JSON file for the rows and medians")
    parser.add_argument("--limit", type=int, default=3, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--llama", help="llama-server's /v1 URL")
    parser.add_argument("--sets", default="", help="comma-separated sets to run (default all)")
    args = parser.parse_args()
    asker = Asker(args.max_tokens)
    for base in filter(None, (args.url, args.llama)):
        asker.wait_for(base)
        asker.ask(base, "Say hi.", None)  # load and warm before anything is timed
    asker.ask(args.url, "Say hi.", "none")
    rows = race(asker, args.url, args.llama, prompt_sets(args.limit, args.sets))
    summary = summarise(rows)
    Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
