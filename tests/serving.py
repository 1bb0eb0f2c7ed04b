"""Start `specdeck serve` as a real process on 127.0.0.1 over a tiny saved model, for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# word-level tokenizer: the template must only produce known words
CHAT_TEMPLATE = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
                 "{% if add_generation_prompt %}w4{% endif %}")


def save_tiny_model(folder: Path, seed: int = 1, context: int = 4096) -> Path:
    """The tiny model of tests/tiny.py with a chat template, saved as an HF folder."""
    from tests.tiny import tiny_llama  # torch: only where a test saves a model

    model = tiny_llama(seed=seed)
    model.hf.config.max_position_embeddings = context  # room for long streams
    model.tokenizer.chat_template = CHAT_TEMPLATE
    model.hf.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def specdeck_serve(args: Sequence[str], log: Path, timeout: float = 180.0,
                   env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `specdeck serve ARGS` until the block ends; yields its base URL (…/v1)."""
    with serve_process(args, log, timeout, env) as (_, url):
        yield url


@contextmanager
def serve_process(args: Sequence[str], log: Path, timeout: float = 180.0,
                  env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """`specdeck serve ARGS` as a process, healthy: yields it and its base URL (…/v1).
    env: variables set for it on top of this process's (SPECDECK_HOME, say)."""
    port = free_port()
    # tiny models: threads only add contention
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "app", "serve", *args,
                                    "--port", str(port)], cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        _wait_healthy(process, port, log, timeout)
        yield process, f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_healthy(process: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"specdeck serve exited early:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"specdeck serve did not start in {timeout} s:\n{log.read_text()}")
