"""Disk, memory and start-up of the default pair: specdeck serve against llama-server, same files.

Usage: python scripts/footprint.py [PAIR] [--requests 10] [--rounds 2] [--llama-server PATH]
For each pulled model of the pair: bytes on disk in its folder against its GGUF's. Then, in
rounds alternating the two engines: each server started cold on the pair (llama-server with
`-m TARGET -md DRAFT`), the seconds from start to its first answer, then `requests` greedy
chat requests of 128 tokens; peak RSS (VmHWM) and RSS after the last request (VmRSS) of the
server process. Then the planner's estimate of the same (runtime, weights, KV caches) at the
context the requests held (the KV cache's first allocation) and at the Models tab's 4096
tokens, and the measured peak over the first. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.catalogue import sizing  # noqa: E402
from app.catalogue.registry import load_catalogue  # noqa: E402
from app.store.layout import model_path  # noqa: E402

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain what a hash map is in two sentences.",
           "What is 17 * 23? Show your steps.",
           "List three uses of the Linux command grep.",
           "Rewrite in the passive voice: The cat chased the mouse."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def run_server(command: list[str], base: str, requests: int) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = httpx.Client(timeout=600)
    try:
        first = None
        while first is None:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {proc.returncode}")
            try:
                ask(client, base, "Say hi.", 8)
                first = time.perf_counter() - start
            except httpx.HTTPError:
                time.sleep(0.5)
        tok_s = []
        for i in range(requests):
            tokens, wall = ask(client, base, PROMPTS[i % len(PROMPTS)], 128)
            tok_s.append(tokens / wall)
        mem = status(proc.pid)
        return {"first_answer_s": round(first, 1), "peak_rss_gib": mem["VmHWM"] / 2**30,
                "steady_rss_gib": mem["VmRSS"] / 2**30,
                "median_tok_s": sorted(tok_s)[len(tok_s) // 2]}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def ask(client: httpx.Client, base: str, text: str, max_tokens: int) -> tuple[int, float]:
    t = time.perf_counter()
    r = client.post(f"{base}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
        "temperature": 0})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"], time.perf_counter() - t


def disk(path: Path) -> dict:
    folder_bytes = sum(f.stat().st_size for f in path.parent.rglob("*") if f.is_file())
    return {"gguf_gib": path.stat().st_size / 2**30, "folder_gib": folder_bytes / 2**30,
            "ratio": folder_bytes / path.stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pair", nargs="?", default="qwen2.5-coder-1.5b+0.5b")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llama-server", default="")
    args = parser.parse_args()
    catalogue = load_catalogue()
    pair = catalogue.pair(args.pair)
    target = model_path(pair.target, "torch")
    draft = model_path(pair.drafter, "torch") if pair.drafter else None
    report = {"pair": args.pair, "disk": {m.name: disk(m) for m in (target, draft) if m},
              "specdeck": [], "llama-server": []}
    for _ in range(args.rounds):
        port = free_port()
        report["specdeck"].append(run_server(
            [str(ROOT / ".venv/bin/specdeck"), "serve", "--target", args.pair, "--port",
             str(port)], f"http://127.0.0.1:{port}", args.requests))
        if args.llama_server:
            port = free_port()
            command = [args.llama_server, "-m", str(target), "--port", str(port), "--jinja",
                       "-t", str(os.cpu_count())]
            if draft:
                command += ["-md", str(draft)]
            report["llama-server"].append(run_server(command, f"http://127.0.0.1:{port}",
                                                     args.requests))
    report["estimate"] = estimate(pair, report["specdeck"])
    print(json.dumps(report, indent=1))


def estimate(pair, runs: list[dict]) -> dict:
    """The planner's memory for the pair against serve's measured peak."""
    from backends.torch.static_kv import FIRST_CAPACITY

    gib = 2**30
    held, tab = (sizing.pair_fit(pair, "torch", "cpu", 64 * gib, context).memory_bytes / gib
                 for context in (FIRST_CAPACITY, 4096))
    peak = sorted(run["peak_rss_gib"] for run in runs)[len(runs) // 2] if runs else None
    return {"served_context": FIRST_CAPACITY, "estimate_gib": held, "estimate_4096_gib": tab,
            "measured_peak_gib": peak, "peak_over_estimate": peak / held if peak else None}


if __name__ == "__main__":
    main()
