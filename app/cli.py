"""`specdeck` command line: argparse subcommands over the engine, store, server and UI.

Knows: flags, their validation and how to print results (text or the --json contract).
Must not know: array libraries (backends are loaded through backends.load_backend). Each
subcommand lives in the module that owns it and registers itself through `add_subcommand`;
a user error prints one line naming the fix and exits 2, never a traceback; output piped
into a reader that stops early (`| head`) ends the command quietly.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app import remote_flags
from app.core.types import Done, SamplingParams, SpecdeckError, Step
from app.flags import add_model_arguments

# modules that define add_subcommand(subparsers); missing ones are skipped until they exist
SUBCOMMAND_MODULES = (
    "app.store.cli", "app.bench.cli", "app.serve.server", "app.ui", "app.catalogue.recipe",
    "app.train", "app.store.cache_cli")
SEED_LIMIT = 2**64  # numpy's generators take seeds in [0, 2**64)
CLOSED_PIPE_EXIT = 141  # what a shell reports for a writer ended by SIGPIPE (128 + 13)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except SpecdeckError as error:
        print(f"specdeck: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdeck: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _closed_pipe()
    except OSError as error:  # a file or folder the command needs: one line, not a traceback
        print(f"specdeck: error: {os_error_message(error)}", file=sys.stderr)
        return 2


def _closed_pipe() -> int:
    # the reader left (`| head`): later writes, and the interpreter's final flush, go nowhere
    # instead of raising again
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return CLOSED_PIPE_EXIT


def os_error_message(error: OSError) -> str:
    """An OSError as one line naming the fix; SPECDECK_HOME that is not a folder is named."""
    home = os.environ.get("SPECDECK_HOME")
    if home and Path(home).exists() and not Path(home).is_dir():
        return (f"SPECDECK_HOME={home} is a file, not a folder: set SPECDECK_HOME to a folder "
                "(or unset it to use ~/.cache/specdeck)")
    where = f": {error.filename}" if error.filename else ""
    return f"{error.strerror or error}{where}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdeck", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(metavar="COMMAND")
    _add_generate(sub)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name == name:
                continue
            raise
        register = getattr(module, "add_subcommand", None)
        if register is not None:
            register(sub)
    return parser


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise SpecdeckError(f"--seed must be in 0..2**64-1 (got {args.seed}); leave it out "
                            "for a random seed")
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, max_new_tokens=args.max_new_tokens,
                          stop=tuple(args.stop))


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate a completion with speculative decoding")
    add_model_arguments(p)
    add_sampling_arguments(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="file holding the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--json", action="store_true", help="print one JSON object (a contract)")
    remote_flags.add_remote_arguments(p)
    p.set_defaults(handler=_generate)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise SpecdeckError(f"prompt file not found: {path}")
        text = _prompt_text(path)
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise SpecdeckError("give a prompt with --prompt TEXT or --prompt-file FILE")
    if not text.strip():
        raise SpecdeckError("the prompt is empty: give some text to continue")
    return text


def _prompt_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise SpecdeckError(f"prompt file {path} is not UTF-8 text (byte {error.start} "
                            "cannot be decoded): give a text file") from error
    if "\x00" in text:
        raise SpecdeckError(f"prompt file {path} holds NUL bytes, so it is not text: give a "
                            "text file")
    return text


def _generate(args: argparse.Namespace) -> int:
    from app.core.prompt import encode_prompt
    from app.loading import load_engine

    params = sampling_params(args)
    text = read_prompt(args)
    if args.remote:
        return remote_flags.generate(args, text, params)
    loaded = load_engine(args)
    prompt_ids = encode_prompt(loaded.engine.target.tokenizer, text, chat=args.chat,
                               system=args.system)
    done = _stream(loaded.engine, prompt_ids, params, echo=not args.json)
    if done.error:
        raise SpecdeckError(f"generation failed: {done.error}")
    if args.json:
        print(json.dumps(result_json(done, loaded), ensure_ascii=False))
    else:
        s = done.stats
        # --drafter auto: the planner's choice and why (--json adds why not the others)
        drafter = loaded.notes[0] if loaded.notes else f"drafter {loaded.drafter_name}"
        print(f"\n[{s.n_new_tokens} tokens, {s.decode_tok_s:.2f} tok/s, τ "
              f"{s.mean_accepted_length:.2f}, acceptance {s.acceptance_rate:.0%}, "
              f"{drafter}, k {loaded.engine.k}]", file=sys.stderr)
    return 0


def _stream(engine: Any, prompt_ids: list[int], params: SamplingParams, echo: bool) -> Done:
    cancel = threading.Event()
    done: Done | None = None
    try:
        for event in engine.generate(prompt_ids, params, cancel=cancel):
            if isinstance(event, Step) and echo:
                print(event.text, end="", flush=True)
            elif isinstance(event, Done):
                done = event
    except KeyboardInterrupt:
        cancel.set()
        raise
    assert done is not None
    return done


def result_json(done: Done, loaded: Any) -> dict[str, Any]:
    """The generate --json contract: other tools read these names."""
    engine = loaded.engine
    return {
        "text": done.text,
        "token_ids": list(done.token_ids),
        "stop_reason": done.stop_reason,
        **done.stats.to_dict(),
        "drafter": loaded.drafter_name,
        "drafter_reasons": list(loaded.notes),  # --drafter auto: the planner's lines
        "k": engine.k,
        "backend": loaded.backend_name,
        "device": engine.target.device,
        "dtype": engine.target.dtype,
        "dtype_reason": getattr(engine.target, "dtype_reason", ""),
        "target": engine.target.name,
        "from_draft": list(done.from_draft),
    }
