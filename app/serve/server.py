"""`specdeck serve`: an OpenAI-compatible HTTP API with speculative stats, over one SpecEngine
(--target) or every installed pair by its id (app/serve/pool.py loads and unloads them). This
module is its command line: flags, loading the served pair or the pool, the listening socket
and shutdown; the routes are app/serve/routes.py's, a request's job app/serve/jobs.py's, the
run relay app/serve/relay.py's, the reply shapes and SSE app/serve/replies.py's.

Threads: each generation runs on its own worker thread, never on the event loop, and so does
each request's parsing and tokenizing (a 20 MB prompt must not freeze /health). The worker
holds engine.lock for the whole generation, so requests queue per model, and it closes the
engine's generator in a finally: a client that disconnects leaves the cache rewound. The
generation's steps, loads and warm-ups themselves run on the process's one compute thread
(app/runtime/compute.py: OpenMP slows every thread once two have computed).
Admission (app/serve/admission.py) bounds the body size and the queue; a client that leaves,
streaming or not, and server shutdown (SIGTERM, SIGINT) cancel the generation.
"""

import argparse
import errno
import os
import socket
import sys
import threading
from typing import Any

from app.core.types import SpecdeckError
from app.flags import DEFAULT_K, add_model_arguments
from app.runtime import compute
from app.serve.admission import Gate
from app.serve.jobs import DEFAULT_MAX_BODY_MB, DEFAULT_MAX_WAITING, Served
from app.serve.metrics import Metrics
from app.serve.pool import (
    DEFAULT_KEEP_ALIVE,
    NEED_CONTEXT,
    Listed,
    Pool,
    need_bytes,
    parse_duration,
)
from app.serve.routes import build_app

LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_PARALLEL = 4  # llama-server's default slots
SHUTDOWN_GRACE_S = 5  # after SIGTERM, cancelled streams have this long to send their end


def add_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible API with speculative "
                              "stats (/v1/chat/completions, /v1/completions, /metrics)")
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $SPECDECK_API_KEY); "
                        "repeat it for several users: each key's replies are a history of "
                        "their own, never drafted for another key")
    p.add_argument("--api-keys-file", help="a file of API keys, one a line (# comments), "
                                           "beside any --api-key")
    p.add_argument("--parallel", "-np", type=int, default=DEFAULT_PARALLEL,
                   help="streams generated at once, stepped together in one forward (default "
                        f"{DEFAULT_PARALLEL}; fewer when memory holds fewer streams of "
                        "--stream-context tokens; 1: one request at a time)")
    p.add_argument("--stream-context", type=int, default=NEED_CONTEXT,
                   help=f"the tokens each stream is sized for (default {NEED_CONTEXT})")
    p.add_argument("--served-model-name", help="model id clients send (default: target name)")
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                   help=f"refuse larger request bodies with 413 (default {DEFAULT_MAX_BODY_MB:g})")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests that may wait while one generates; more get 429 with "
                        f"Retry-After (default {DEFAULT_MAX_WAITING})")
    installed = p.add_argument_group("without --target: every installed pair, by its id")
    installed.add_argument("--keep-alive", default=DEFAULT_KEEP_ALIVE,
                           help="unload a pair idle this long (5m, 30s, 1h; 0 = when its "
                                f"request ends; -1 = never; default {DEFAULT_KEEP_ALIVE}); a "
                                "request's keep_alive overrides it for its pair")
    installed.add_argument("--memory-limit", help="memory the loaded pairs may use, e.g. 16GB "
                           "(default: what is free at start); the planner's sizes decide what "
                           "fits, idle pairs are unloaded to make room")
    installed.add_argument("--max-loaded", type=int, default=0,
                           help="pairs loaded at once at most (default 0: memory decides)")
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.loading import load_engine

    check_limits(args)
    if not args.target:
        return _serve_installed(args)
    listener = listen_socket(args.host, args.port)  # before the model: a taken port fails fast
    loaded = compute.call(load_engine, args)
    engine = loaded.engine
    compute.call(engine.warm_up)  # the first request does not pay for timing the verify costs
    streams = compute.call(stream_slots, args, loaded)
    served = Served(engine=engine, model_id=args.served_model_name or engine.target.name,
                    drafter_name=loaded.drafter_name, backend_name=loaded.backend_name,
                    default_k=request_k_default(args.k),
                    api_keys=api_keys(args), gate=Gate(args.max_waiting),
                    max_body_bytes=int(args.max_body_mb * 2**20), pair=loaded.pair,
                    streams=streams)
    _warn_if_open(args.host, served.keys())
    for note in getattr(loaded, "notes", ()):
        print(f"specdeck: {note}", file=sys.stderr)
    print(f"specdeck: {streams.capacity.summary()}", file=sys.stderr)
    print(f"specdeck: serving {served.model_id} (drafter {served.drafter_name}, k {engine.k}) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(build_app(served), log_level="warning",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    cancelling_server()(config, served.gate).run(sockets=[listener])
    compute.quiet(SHUTDOWN_GRACE_S)  # the cancelled generation's last step ends inside torch
    return 0


def stream_slots(args: argparse.Namespace, loaded: Any) -> Any:
    """The scheduler of the served target's streams: --parallel slots, fewer where memory
    holds fewer streams of --stream-context tokens (each slot's KV, the draft model's too)."""
    from app.catalogue import hardware
    from app.catalogue.sizing import loaded_stream_bytes
    from app.runtime.streams import Streams, capacity, fork_engines

    engine = loaded.engine
    context = min(args.stream_context, engine.target.context_length)
    # the target's by its config (a window's fixed rows, a hybrid's state), as the planner
    # counts it; the draft model's by its own count
    path = getattr(getattr(loaded.pair, "spec", None), "target", None)
    target = loaded_stream_bytes(engine.target, path, loaded.backend_name, context)
    draft = loaded_stream_bytes(loaded.draft, None, loaded.backend_name, context) \
        if loaded.draft is not None else 0
    free = hardware.available_memory(loaded.backend_name, args.device)
    fit = capacity(args.parallel, target + draft, free, context, plain_stream_bytes=target)
    return Streams(fork_engines(engine, fit.slots), loaded.rebuild or (lambda kind: None),
                   default=(loaded.drafter_name, engine.drafter), capacity=fit)


def request_k_default(k: int | str) -> int | str:
    """The server's --k for requests that name their own drafter: a plain server's k 0 would
    turn their drafter off, so they get the default."""
    return k if k == "auto" or (isinstance(k, int) and k > 0) else DEFAULT_K


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key (each), $SPECDECK_API_KEY when none is given, and --api-keys-file's lines."""
    keys = list(getattr(args, "api_key", None) or [])
    if not keys and os.environ.get("SPECDECK_API_KEY"):
        keys.append(os.environ["SPECDECK_API_KEY"])
    path = getattr(args, "api_keys_file", None)
    if path:
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as error:
            raise SpecdeckError(f"cannot read --api-keys-file {path}: {error.strerror}") \
                from None
        keys += [line.strip() for line in lines if line.strip() and
                 not line.lstrip().startswith("#")]
    if any(not key or any(c.isspace() for c in key) for key in keys):
        raise SpecdeckError("an API key must be non-empty and hold no spaces")
    return tuple(dict.fromkeys(keys))


def _warn_if_open(host: str, keys: tuple[str, ...]) -> None:
    if host not in LOOPBACK and not keys:
        print(f"specdeck: warning: serving on {host} without --api-key: anyone who can "
              "reach this machine can use the model", file=sys.stderr)


def _serve_installed(args: argparse.Namespace) -> int:
    """No --target: serve every installed pair by its id, loading each on first use."""
    import uvicorn

    if args.served_model_name:
        raise SpecdeckError("--served-model-name needs --target: without it each installed "
                            "pair is served by its id")
    keep_alive = parse_duration(args.keep_alive, "--keep-alive")
    listed, budget, runtime = installed_pairs(args)
    listener = listen_socket(args.host, args.port)
    front = Served(engine=None, model_id="specdeck", drafter_name=args.drafter,
                   api_keys=api_keys(args), gate=Gate(args.max_waiting),
                   max_body_bytes=int(args.max_body_mb * 2**20))
    pool = Pool(listed, lambda pair_id: _load_pair(args, front, pair_id), budget, keep_alive,
                args.max_loaded, runtime_bytes=runtime,
                log=lambda line: print(f"specdeck: {line}", file=sys.stderr, flush=True))
    _warn_if_open(args.host, front.keys())
    for item in listed:
        print(f"specdeck: {item.pair_id}: drafter {item.drafter}, needs "
              f"{item.need_bytes / 1e9:.2f} GB", file=sys.stderr)
    print(f"specdeck: serving {len(listed)} installed pair(s) on http://{args.host}:{args.port}"
          f"/v1, each loaded on first use ({pool.usable_bytes / 1e9:.2f} GB usable, keep-alive "
          f"{args.keep_alive})", file=sys.stderr, flush=True)
    pool.start_reaper()
    config = uvicorn.Config(build_app(front, pool), log_level="warning",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    try:
        cancelling_server()(config, front.gate).run(sockets=[listener])
    finally:
        pool.stop()
        compute.quiet(SHUTDOWN_GRACE_S)
    return 0


def installed_pairs(args: argparse.Namespace) -> tuple[list[Listed], int, int]:
    """The installed pairs with the drafter each would run (the planner's choice, or
    --drafter) and its memory need; the memory budget they share, and what the process
    itself takes of it (sizing.RUNTIME_BYTES)."""
    from app import store
    from app.catalogue import hardware, planner, sizing
    from app.catalogue.registry import load_catalogue
    from app.loading import SUFFIX_NOTE, history_kind
    from backends import detect_backend

    catalogue = load_catalogue()
    backend = detect_backend() if args.backend == "auto" else args.backend
    if args.max_loaded < 0:
        raise SpecdeckError(f"--max-loaded must be >= 0 (got {args.max_loaded})")
    budget = (sizing.parse_bytes(args.memory_limit) if args.memory_limit
              else hardware.available_memory(backend, args.device))
    rows = [r for r in store.list_pairs(backend, args.device, memory=budget, catalogue=catalogue)
            if r.installed]
    if not rows:
        raise SpecdeckError(f"no pair is installed for the {backend} backend: run `specdeck "
                            f"pull {catalogue.default_pair}` (`specdeck models` lists the "
                            "pairs), or give a model with --target PATH")
    listed = []
    for row in rows:
        plan = planner.plan(row.pair.id, backend, args.device, memory=budget,
                            catalogue=catalogue,
                            installed=lambda model: store.model_path(model, backend))
        drafter = args.drafter if args.drafter != "auto" else plan.choice.label
        reason = "--drafter" if drafter == args.drafter else plan.choice.reason
        if history_kind(drafter, not getattr(args, "no_history", False), args.drafter) \
                != drafter:
            drafter, reason = "suffix", SUFFIX_NOTE.removeprefix("drafter: suffix, ")
        listed.append(Listed(row.pair.id, row.pair.name, drafter, reason, need_bytes(plan.fit),
                             row.pair.target.arch.context))
    return listed, budget, sizing.RUNTIME_BYTES.get(backend, 0)


def _load_pair(args: argparse.Namespace, front: Served, pair_id: str) -> Served:
    """Load one installed pair as --target PAIR would, with the planner's drafter."""
    from app.loading import load_engine

    flags = argparse.Namespace(**{**vars(args), "target": pair_id,
                                  "drafter": args.drafter})
    loaded = compute.call(load_engine, flags)
    compute.call(loaded.engine.warm_up)
    for note in loaded.notes:
        print(f"specdeck: {pair_id}: {note}", file=sys.stderr)
    return Served(engine=loaded.engine, model_id=pair_id, drafter_name=loaded.drafter_name,
                  backend_name=loaded.backend_name,
                  default_k=request_k_default(args.k),
                  api_keys=front.keys(), gate=front.gate, max_body_bytes=front.max_body_bytes,
                  pair=loaded.pair,
                  metrics=front.pair_metrics.setdefault(pair_id, Metrics()))


def check_limits(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise SpecdeckError(f"--port must be in 1..65535 (got {args.port})")
    if not args.max_body_mb > 0:  # also refuses NaN
        raise SpecdeckError(f"--max-body-mb must be > 0 (got {args.max_body_mb})")
    if getattr(args, "parallel", 1) < 1:
        raise SpecdeckError(f"--parallel must be >= 1 (got {args.parallel})")
    if args.max_waiting < 0:
        raise SpecdeckError(f"--max-waiting must be >= 0 (got {args.max_waiting})")


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now; SpecdeckError naming --port when it is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as error:
        raise SpecdeckError(f"cannot serve on {host}: {error}: give another --host") from error
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart at once
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise SpecdeckError(f"port {port} on {host} is in use (another server?): choose "
                                "another with --port N") from error
        raise SpecdeckError(f"cannot bind {host}:{port}: {error.strerror}: choose another "
                            "--host or --port") from error
    sock.set_inheritable(True)
    return sock


def cancelling_server() -> type:
    """uvicorn's Server, cancelling on shutdown (built here: --help never imports uvicorn)."""
    import uvicorn

    class CancellingServer(uvicorn.Server):
        """uvicorn that cancels live generations on SIGTERM/SIGINT instead of awaiting them."""

        def __init__(self, config: Any, gate: Gate) -> None:
            super().__init__(config)
            self.gate = gate

        def handle_exit(self, sig: int, frame: Any) -> None:
            # runs as a signal handler on the loop's thread: setting the generations' Events
            # there could wait on a lock that thread holds, so another thread does it
            threading.Thread(target=self.gate.stop, name="specdeck-stop").start()
            super().handle_exit(sig, frame)

    return CancellingServer
