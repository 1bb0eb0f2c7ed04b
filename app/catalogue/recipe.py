"""`specdeck recipe`: the command line that runs a specdeck pair on vLLM, SGLang or llama.cpp.

Knows: each engine's current speculative-decoding flags (as documented in the brief's
LANDSCAPE.md: vLLM's `--speculative-config` JSON, SGLang's `--speculative-*` flags,
llama-server's `--spec-*` flags) and how a catalogue pair maps onto them. Must not know:
downloads, array libraries; it prints, it runs nothing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass, replace
from typing import Any

from app import drafters
from app.core.types import SpecdeckError

ENGINES = ("vllm", "sglang", "llama.cpp")
DRAFTERS = drafters.KINDS
PORTS = {"vllm": 8000, "sglang": 30000, "llama.cpp": 8080}  # each engine's own default
NGRAM_MIN, NGRAM_MAX = 1, 4  # specdeck's prompt-lookup window (app/drafters/ngram.py)
VLLM_METHODS = {"ngram": "ngram", "draft": "draft_model", "eagle3": "eagle3", "mtp": "mtp",
                "dflash": "dflash", "medusa": "medusa"}
SGLANG_ALGORITHMS = {"ngram": "NGRAM", "draft": "STANDALONE", "eagle3": "EAGLE3",
                     "mtp": "EAGLE", "dflash": "DFLASH"}
LLAMA_TYPES = {"eagle3": "draft-eagle3", "mtp": "draft-mtp", "dflash": "draft-dflash"}


@dataclass(frozen=True)
class Pairing:
    """A target and its drafter, as each engine names them."""

    name: str
    drafter: str  # one of DRAFTERS
    k: int
    target_repo: str | None = None  # hub repo id or HF folder: vLLM, SGLang
    target_gguf: str | None = None  # .gguf path or file name: llama.cpp
    draft_repo: str | None = None
    draft_gguf: str | None = None
    fetch_hint: str = ""  # where the .gguf files come from, for llama.cpp


@dataclass(frozen=True)
class Recipe:
    engine: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    base_url: str = ""
    notes: tuple[str, ...] = ()

    @property
    def command(self) -> str:
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env]
        return " ".join([*env, *(shlex.quote(a) for a in self.argv)])


def build(pairing: Pairing, engine: str, tp: int = 1, port: int | None = None) -> Recipe:
    """The recipe for one engine; SpecdeckError when the engine cannot run this pairing."""
    if engine not in ENGINES:
        raise SpecdeckError(f"unknown engine {engine!r}: use {', '.join(ENGINES)}")
    if tp < 1:
        raise SpecdeckError(f"--tp must be >= 1 (got {tp})")
    if pairing.drafter not in DRAFTERS:
        raise SpecdeckError(f"no engine runs {pairing.drafter} drafting: pick a pair with one "
                            f"of {', '.join(DRAFTERS)}")
    if pairing.drafter != "none" and pairing.k < 1:
        raise SpecdeckError(f"k must be >= 1 for drafter {pairing.drafter} (got {pairing.k})")
    port = port or PORTS[engine]
    build_for = {"vllm": _vllm, "sglang": _sglang, "llama.cpp": _llama}[engine]
    argv, env, notes = build_for(pairing, tp, port)
    return Recipe(engine=engine, argv=tuple(argv), env=tuple(env),
                  base_url=f"http://127.0.0.1:{port}/v1", notes=tuple(notes))


def vllm_speculative_config(pairing: Pairing) -> dict[str, Any] | None:
    """vLLM's --speculative-config JSON (keys of vllm/config/speculative.py)."""
    if pairing.drafter == "none":
        return None
    config: dict[str, Any] = {"method": VLLM_METHODS[pairing.drafter]}
    if pairing.drafter in ("draft", "eagle3", "dflash", "medusa"):
        config["model"] = _need(pairing.draft_repo, "vLLM", "drafter's hub repo")
    config["num_speculative_tokens"] = pairing.k
    if pairing.drafter == "ngram":
        config |= {"prompt_lookup_max": NGRAM_MAX, "prompt_lookup_min": NGRAM_MIN}
    return config


def _vllm(p: Pairing, tp: int, port: int) -> tuple[list[str], list, list[str]]:
    argv = ["vllm", "serve", _need(p.target_repo, "vLLM", "target's hub repo"),
            "--host", "127.0.0.1", "--port", str(port)]
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    config = vllm_speculative_config(p)
    if config is not None:
        argv += ["--speculative-config", json.dumps(config)]
    return argv, [], ["vLLM exports vllm:spec_decode_* counters on /metrics"]


def _sglang(p: Pairing, tp: int, port: int) -> tuple[list[str], list, list[str]]:
    argv = ["python", "-m", "sglang.launch_server",
            "--model-path", _need(p.target_repo, "SGLang", "target's hub repo"),
            "--host", "127.0.0.1", "--port", str(port), "--enable-metrics"]
    if tp > 1:
        argv += ["--tp-size", str(tp)]
    if p.drafter == "none":
        return argv, [], []
    if p.drafter not in SGLANG_ALGORITHMS:
        raise SpecdeckError(f"SGLang has no {p.drafter} drafter: choose another engine")
    argv += ["--speculative-algorithm", SGLANG_ALGORITHMS[p.drafter]]
    if p.drafter in ("draft", "eagle3", "dflash"):
        argv += ["--speculative-draft-model-path",
                 _need(p.draft_repo, "SGLang", "drafter's hub repo")]
    # a chain of k drafts: top-k 1, and the verified token counts among the draft tokens
    if p.drafter != "ngram":
        argv += ["--speculative-num-steps", str(p.k), "--speculative-eagle-topk", "1"]
    argv += ["--speculative-num-draft-tokens", str(p.k + 1)]
    notes = ["SGLang NGRAM runs on CUDA only"] if p.drafter == "ngram" else []
    return argv, [], notes


def _llama(p: Pairing, tp: int, port: int) -> tuple[list[str], list, list[str]]:
    argv = ["llama-server", "-m", _need(p.target_gguf, "llama.cpp", "target's .gguf"),
            "-ngl", "99", "--host", "127.0.0.1", "--port", str(port)]
    env = [("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(tp))))] if tp > 1 else []
    notes = [f"llama-server splits layers over the {tp} visible GPUs"] if tp > 1 else []
    notes += [p.fetch_hint] if p.fetch_hint else []
    if p.drafter == "none":
        return argv, env, notes
    if p.drafter == "ngram":
        argv += ["--spec-type", "ngram-simple", "--spec-ngram-size-m", str(p.k)]
    elif p.drafter == "draft":
        argv += ["--spec-draft-model", _need(p.draft_gguf, "llama.cpp", "draft model's .gguf"),
                 "--spec-draft-ngl", "99"]
    elif p.drafter in LLAMA_TYPES:
        argv += ["--spec-type", LLAMA_TYPES[p.drafter]]
        if p.drafter != "mtp":
            argv += ["--spec-draft-model", _need(p.draft_gguf, "llama.cpp", "drafter's .gguf")]
        else:
            argv += ["--parallel", "1"]  # llama.cpp runs MTP with one slot only
    else:
        raise SpecdeckError(f"llama.cpp has no {p.drafter} drafter: choose vllm")
    argv += ["--spec-draft-n-max", str(p.k), "--spec-draft-n-min", "0"]
    return argv, env, notes + ["llama-server reports timings.draft_n / draft_n_accepted"]


def _need(value: str | None, engine: str, what: str) -> str:
    if not value:
        hint = ("a .gguf file (--target FILE.gguf)" if "gguf" in what
                else "a hub repo id or an HF folder (--target ORG/NAME)")
        raise SpecdeckError(f"{engine} needs the {what}, and this pairing has none: give {hint}")
    return value


# ---- where a pairing comes from ---------------------------------------------------------

def from_catalogue(pair_id: str) -> Pairing:
    """A catalogue pair (models.yaml, read by app/catalogue/registry.py) as engine-facing names."""
    from app.catalogue.registry import load_catalogue

    pair = load_catalogue().pair(pair_id)
    draft = pair.drafter
    return Pairing(name=pair.id, drafter=pair.drafter_kind, k=pair.k,
                   target_repo=_repo(pair.target), target_gguf=_gguf(pair.target),
                   draft_repo=_repo(draft) if draft else None,
                   draft_gguf=_gguf(draft) if draft else None,
                   fetch_hint=f"`specdeck pull {pair.id}` fetches the .gguf files")


def from_paths(target: str, drafter: str, draft: str | None, k: int) -> Pairing:
    """A pairing given on the command line: hub repos, HF folders or .gguf files."""
    if drafter in ("draft", "eagle3", "dflash", "medusa") and not draft:
        raise SpecdeckError(f"--drafter {drafter} needs --draft (its hub repo, folder or .gguf)")

    def split(path: str | None) -> tuple[str | None, str | None]:
        if path is None:
            return None, None
        return (None, path) if path.endswith(".gguf") else (path, None)

    target_repo, target_gguf = split(target)
    draft_repo, draft_gguf = split(draft)
    return Pairing(name=target, drafter=drafter, k=k, target_repo=target_repo,
                   target_gguf=target_gguf, draft_repo=draft_repo, draft_gguf=draft_gguf)


def _repo(model: Any) -> str | None:
    """The hub repo with the original checkpoint; a `-GGUF` repo names it without the suffix."""
    hub = [s for s in model.sources_for("torch") if s.kind == "hub"]
    for source in hub:
        if not source.format.startswith("gguf"):
            return source.repo
    for source in hub:
        if source.repo.lower().endswith("-gguf"):
            return source.repo[:-len("-GGUF")]
    return None


def _gguf(model: Any) -> str | None:
    for source in model.sources_for("torch"):
        if source.format.startswith("gguf"):
            return source.single_file
    return None


# ---- command line -----------------------------------------------------------------------

def add_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("recipe", help="print the vLLM / SGLang / llama.cpp command "
                              "that runs a pair at scale")
    p.add_argument("pair", nargs="?", help="catalogue pair id (see `specdeck models`)")
    p.add_argument("--engine", required=True, choices=ENGINES)
    p.add_argument("--tp", type=int, default=1, help="GPUs for tensor parallelism")
    p.add_argument("--port", type=int, help="port to serve on (default: the engine's own)")
    p.add_argument("--target", help="instead of a pair: target hub repo, HF folder or .gguf")
    p.add_argument("--draft", help="with --target: the draft model or head")
    p.add_argument("--drafter", choices=DRAFTERS, help="with --target: the drafter kind")
    p.add_argument("--k", type=int, help="draft tokens per step (default: the pair's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=_recipe)


def pairing_from_args(args: argparse.Namespace) -> Pairing:
    if args.pair and args.target:
        raise SpecdeckError("give a catalogue pair or --target, not both")
    if args.pair:
        pairing = from_catalogue(args.pair)
        if args.drafter or args.draft:
            raise SpecdeckError("--drafter and --draft go with --target; a pair names its own")
        return pairing if args.k is None else replace(pairing, k=args.k)
    if not args.target:
        raise SpecdeckError("give a catalogue pair id (see `specdeck models`) or --target")
    drafter = args.drafter or ("draft" if args.draft else "ngram")
    return from_paths(args.target, drafter, args.draft, 4 if args.k is None else args.k)


def _recipe(args: argparse.Namespace) -> int:
    recipe = build(pairing_from_args(args), args.engine, tp=args.tp, port=args.port)
    if args.json:
        print(json.dumps({"engine": recipe.engine, "command": recipe.command,
                          "argv": list(recipe.argv), "env": dict(recipe.env),
                          "base_url": recipe.base_url, "notes": list(recipe.notes)}))
        return 0
    print(recipe.command)
    for note in (*recipe.notes, f"then point specdeck at {recipe.base_url}"):
        print(f"# {note}", file=sys.stderr)
    return 0
