"""From --remote flags to a connected RemoteEngine, and its runs in the --json contract.

Knows: the --remote/--api-key/--model flags, which local flags a remote engine ignores or
refuses, how a remote run fills the generate --json contract (what the engine did not report
is null, and a note says so). Must not know: the wire formats (app/serve/remote_engine.py owns
them), array libraries, the step loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from app.core.types import Done, SpecdeckError, Step
from app.flags import DEFAULT_DRAFTER, DEFAULT_K

if TYPE_CHECKING:  # httpx loads only when a command goes remote
    from app.serve.remote_engine import RemoteEngine

LOCAL_ONLY = ("target", "draft")


def add_remote_arguments(p: argparse.ArgumentParser) -> None:
    """--remote URL, --api-key KEY and --model NAME for a command that can run remotely."""
    p.add_argument("--remote", metavar="URL",
                   help="drive an OpenAI-compatible server (vLLM, SGLang, llama-server, "
                        "specdeck serve) at http://HOST:PORT/v1 instead of a local model")
    p.add_argument("--api-key", default=os.environ.get("SPECDECK_API_KEY"),
                   help="the --remote server's key, sent as 'Authorization: Bearer KEY' "
                        "(default: $SPECDECK_API_KEY; the environment keeps it out of ps)")
    p.add_argument("--model", help="which of the --remote server's models (default: its first)")


def connect_remote(args: argparse.Namespace) -> RemoteEngine:
    """The engine --remote names; every user mistake raises SpecdeckError naming the fix."""
    given = [f"--{name}" for name in LOCAL_ONLY if getattr(args, name, None)]
    if given:
        raise SpecdeckError(f"{' and '.join(given)} load a local model: drop them with --remote "
                            "(the server holds its model; choose among its models with --model)")
    from app.serve.remote_engine import connect

    url = check_url(args.remote)
    # only a changed flag is the user's wish (the server's own choice stands otherwise), and
    # only a specdeck server takes a per-request drafter and k
    drafter = getattr(args, "drafter", DEFAULT_DRAFTER)
    k = getattr(args, "k", DEFAULT_K)
    return connect(url, model=args.model, api_key=args.api_key or None,
                   drafter=drafter if drafter != DEFAULT_DRAFTER else None,
                   k=k if k != DEFAULT_K else None)


def check_url(url: str) -> str:
    """An http(s) URL with a host; anything else is refused before a connection is tried."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecdeckError(f"--remote takes a server URL like http://127.0.0.1:8000/v1 "
                            f"(got {url!r})")
    return url


def unreported(engine: RemoteEngine, names: Any) -> list[str]:
    """Of the contract's stat names, those the engine's last run did not report."""
    return [name for name in names if name not in engine.reported]


def result_json(done: Done, engine: RemoteEngine) -> dict[str, Any]:
    """The generate --json contract for a remote run: unknown values are null, not zero."""
    stats = done.stats.to_dict()
    missing = unreported(engine, stats)
    stats |= dict.fromkeys(missing)
    return {
        "text": done.text,
        "token_ids": list(done.token_ids) if done.token_ids else None,
        "stop_reason": done.stop_reason,
        **stats,
        "drafter": engine.drafter_name,
        "k": engine.k if engine.kind == "specdeck" else None,
        "backend": "remote",
        "device": engine.target.device,
        "dtype": None if engine.target.dtype == "?" else engine.target.dtype,
        "target": engine.target.name,
        "from_draft": list(done.from_draft) if done.token_ids else None,
        "remote": {"url": engine.base_url, "engine": engine.kind},
        "unreported": missing,
        "note": note(engine, missing),
    }


def note(engine: RemoteEngine, missing: list[str]) -> str:
    """One line saying what the remote engine's statistics cannot show."""
    if not missing:
        return f"{engine.kind} reported every statistic"
    shared = (" its counters are server-wide: other clients' requests are counted too;"
              if engine.kind in ("vllm", "sglang") else "")
    return (f"{engine.kind} at {engine.base_url} did not report {', '.join(missing)};"
            f"{shared} these are null")


def generate(args: argparse.Namespace, text: str, params: Any) -> int:
    """`specdeck generate --remote`: stream the reply, then print the text or the contract."""
    engine = connect_remote(args)
    try:
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            run = engine.chat([*messages, {"role": "user", "content": text}], params)
        else:
            run = engine.generate(text, params)
        done = _collect(run, echo=not args.json)
    finally:
        engine.close()  # on Ctrl-C too: the closed connection cancels the server's request
    if done.error:
        raise SpecdeckError(f"generation failed: {done.error}")
    if args.json:
        print(json.dumps(result_json(done, engine), ensure_ascii=False))
    else:
        print(f"\n[{summary(done, engine)}]", file=sys.stderr)
    return 0


def summary(done: Done, engine: RemoteEngine) -> str:
    """The one-line summary after a remote run; '?' where the engine reported nothing."""
    s = done.stats
    known = "acceptance_rate" in engine.reported
    tau = f"{s.mean_accepted_length:.2f}" if known else "?"
    rate = f"{s.acceptance_rate:.0%}" if known else "?"
    return (f"{s.n_new_tokens} tokens, {s.decode_tok_s:.2f} tok/s, τ {tau}, acceptance "
            f"{rate}, drafter {engine.drafter_name}, {engine.kind} at {engine.base_url}")


def _collect(events: Iterable[Any], echo: bool) -> Done:
    done: Done | None = None
    for event in events:
        if isinstance(event, Step) and echo:
            print(event.text, end="", flush=True)
        elif isinstance(event, Done):
            done = event
    assert done is not None, "a remote run always ends with Done"
    return done
