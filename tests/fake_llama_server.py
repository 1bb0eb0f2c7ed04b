"""A stand-in llama-server for bench's llama.cpp comparison: the flags bench passes, /health,
/v1/models and a streamed /v1/completions shaped like llama-server's (its `__verbose` token
ids, `usage` and `timings` with draft counts). It decodes no model: token i of a reply is
(last prompt token + i + 1) mod 50, so its plain and draft servers agree unless
FAKE_LLAMA_DIVERGE is set for one.

Environment: FAKE_LLAMA_REQUESTS (a file each request body is appended to as a JSON line),
FAKE_LLAMA_CRASH=startup|request (die with SIGILL, as llama.cpp's AMX trap does),
FAKE_LLAMA_DIVERGE=N (the draft server's token N differs), FAKE_LLAMA_OLD=1 (an older
llama-server: --model-draft and --draft-max, no --spec-type).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_MS = 2.0


def parse(argv: list[str]) -> argparse.Namespace:
    old = bool(os.environ.get("FAKE_LLAMA_OLD"))
    p = argparse.ArgumentParser(prog="llama-server")  # unknown flags exit 2, as llama's do
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--ctx-size", type=int)
    p.add_argument("--parallel", type=int)
    p.add_argument("--threads", type=int)
    if old:
        p.add_argument("--model-draft", dest="draft")
    else:
        p.add_argument("--no-webui", action="store_true")
        p.add_argument("--spec-draft-model", dest="draft")
        p.add_argument("--spec-type", choices=["draft-simple", "ngram-simple"])
    return p.parse_args(argv)


HELP_NEW = """----- speculative -----
--spec-draft-model, -md, --model-draft FNAME   draft model for speculative decoding
--spec-draft-n-max N                           number of tokens to draft (default: 3)
--spec-type [none|draft-simple|ngram-simple]   types of speculative decoding
--no-webui                                     disable the Web UI
"""
HELP_OLD = """-md,   --model-draft FNAME    draft model for speculative decoding
--draft-max N                      number of tokens to draft (default: 16)
"""


class Handler(BaseHTTPRequestHandler):
    args: argparse.Namespace

    def log_message(self, *_: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": os.path.basename(self.args.model), "object": "model",
                 "owned_by": "llamacpp"}]})
        else:
            self._json(404, {"error": {"message": "File Not Found", "code": 404}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if os.environ.get("FAKE_LLAMA_REQUESTS"):
            with open(os.environ["FAKE_LLAMA_REQUESTS"], "a") as log:
                log.write(json.dumps({"port": self.args.port, **body}) + "\n")
        if os.environ.get("FAKE_LLAMA_CRASH") == "request":
            os.kill(os.getpid(), signal.SIGILL)
        prompt = body.get("prompt")
        if self.path != "/v1/completions" or not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            self._json(400, {"error": {"message": "want /v1/completions with token ids"}})
            return
        self._stream(body, prompt)

    def _stream(self, body: dict, prompt: list[int]) -> None:
        n = int(body.get("max_tokens") or 16)
        tokens = [(prompt[-1] + i + 1) % 50 for i in range(n)]
        diverge = os.environ.get("FAKE_LLAMA_DIVERGE")
        if diverge is not None and self.args.draft and int(diverge) < n:
            tokens[int(diverge)] = (tokens[int(diverge)] + 7) % 50
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        start = time.perf_counter()
        for tok in tokens:
            time.sleep(TOKEN_MS / 1000 / (2 if self.args.draft else 1))
            chunk = {"choices": [{"text": f" t{tok}", "index": 0, "logprobs": None,
                                  "finish_reason": None}], "object": "text_completion"}
            if body.get("verbose"):
                chunk["__verbose"] = {"content": f" t{tok}", "tokens": [tok], "stop": False}
            self._event(chunk)
        predicted_ms = (time.perf_counter() - start) * 1000
        k = int(body.get("speculative.n_max") or 3)
        drafted = (n - 1) // (k + 1) * k if self.args.draft else 0
        self._event({"choices": [{"text": "", "index": 0, "logprobs": None,
                                  "finish_reason": "length"}], "object": "text_completion"})
        self._event({"choices": [], "object": "text_completion",
                     "usage": {"completion_tokens": n, "prompt_tokens": len(prompt),
                               "total_tokens": n + len(prompt),
                               "prompt_tokens_details": {"cached_tokens": 0}},
                     "timings": {"cache_n": 0, "prompt_n": len(prompt), "prompt_ms": 1.0,
                                 "predicted_n": n, "predicted_ms": predicted_ms,
                                 **({"draft_n": drafted, "draft_n_accepted": drafted}
                                    if self.args.draft else {})}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, payload: dict) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()

    def _json(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(argv: list[str]) -> int:
    if argv == ["--version"]:
        print("version: 1 (fake)\nbuilt with a test", file=sys.stderr)
        return 0
    if argv == ["--help"]:
        print(HELP_OLD if os.environ.get("FAKE_LLAMA_OLD") else HELP_NEW)
        return 0
    args = parse(argv)
    if os.environ.get("FAKE_LLAMA_CRASH") == "startup":
        os.kill(os.getpid(), signal.SIGILL)
    if not os.path.isfile(args.model) or (args.draft and not os.path.isfile(args.draft)):
        print("error: failed to load model", file=sys.stderr)
        return 1
    Handler.args = args
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
