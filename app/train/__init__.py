"""`specdeck train-head TARGET --method eagle3`: train a drafter head for a local target.

Knows: the command's flags, how TARGET names a model (a folder or .gguf file, a catalogue
model id or a pair id, installed), the work folder under SPECDECK_HOME that makes a run
resumable, and the order: collect prompts, train through the backend, write prompts.jsonl
next to the head, register the head so `specdeck models` and the planner list it. Must not
know: array libraries (backends/torch/train_head does the work).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.core.types import SpecdeckError
from app.train import prompts as training_prompts
from app.train import register
from app.train.progress_line import TerminalLine
from backends.train_progress import ProgressFn

METHODS = ("eagle3",)
DEFAULT_PROMPTS = ("spec-bench",)


@dataclass(frozen=True)
class TrainRequest:
    """What the backend's trainer runs (plain values: the backend owns the array types)."""

    target_path: str
    prompts: tuple[str, ...]
    work: str
    out: str
    max_new_tokens: int = 256
    max_prompt_tokens: int = 1024
    # a step reads the target's weights once for every prompt answered together: 64 at a time,
    # Qwen2.5-Coder-1.5B answered at 60-77 tok/s on a 2-core CPU (bf16)
    gen_batch: int = 32
    draft_vocab: int = 32000
    device: str = "auto"
    dtype: str = "auto"
    loop: dict[str, Any] = field(default_factory=dict)  # LoopSettings fields


def run(target: str, prompt_specs: list[str], *, limit: int | None = None, out: str | None = None,
        restart: bool = False, on_progress: ProgressFn | None = None,
        **settings: Any) -> dict[str, Any]:
    """Train a head for target; returns the summary (with 'folder' and, when registered,
    'pair')."""
    from backends.torch.train_head import train_head

    resolved = register.resolve_target(target)
    chosen = training_prompts.collect(prompt_specs, limit)
    work = register.work_dir(resolved.name)
    if restart and work.exists():
        shutil.rmtree(work)
    folder = Path(out) if out else work / "head"
    loop = {k: settings.pop(k) for k in list(settings) if k in _LOOP_KEYS}
    request = TrainRequest(target_path=str(resolved.path),
                           prompts=tuple(p.text for p in chosen.prompts), work=str(work),
                           out=str(folder), loop=loop, **settings)
    progress = on_progress or TerminalLine()
    if chosen.dropped_bench:
        progress(_note(f"{chosen.dropped_bench} prompts are in a bundled benchmark and were "
                       "left out"))
    summary = train_head(request, progress)
    training_prompts.write(folder, chosen.prompts)
    summary = {**summary, "prompts": len(chosen.prompts), "folder": str(folder)}
    if resolved.model is not None and out is None:
        pair, installed = register.install_head(resolved, folder, summary)
        summary = {**summary, "pair": pair, "folder": str(installed)}
    return summary


_LOOP_KEYS = frozenset({"epochs", "lr", "depth", "batch_tokens", "save_every", "seed"})


def _note(message: str) -> Any:
    from backends.train_progress import TrainProgress
    return TrainProgress("note", 0, 0, message=message)


# ---- CLI -------------------------------------------------------------------------------


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser("train-head", help="train an EAGLE-3 drafter head for a local target")
    p.add_argument("target", metavar="TARGET",
                   help="the target: an HF folder or .gguf file, or an installed catalogue "
                        "model or pair id")
    p.add_argument("--method", choices=METHODS, default="eagle3")
    p.add_argument("--prompts", action="append", default=[],
                   help="prompts the target answers: a bundled set (spec-bench, mt-bench, "
                        "humaneval, humaneval-rewrite), a JSONL file or a .txt file, one "
                        "prompt per line (repeatable; default spec-bench)")
    p.add_argument("--limit", type=int, help="use at most this many prompts")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length per prompt")
    p.add_argument("--gen-batch", type=int, default=TrainRequest.gen_batch,
                   help="prompts answered together (one read of the weights per token)")
    p.add_argument("--draft-vocab", type=int, default=32000,
                   help="the head's vocabulary, at most: the target's most frequent tokens "
                        "in its answers (only tokens they hold, in blocks of 64)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4,
                   help="peak learning rate (1e-3 diverged on a 1.5B target)")
    p.add_argument("--depth", type=int, default=7,
                   help="training-time-test steps (the head learns from its own states)")
    p.add_argument("--batch-tokens", type=int, default=1024, help="rows per optimizer step")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="the target's dtype while it answers")
    p.add_argument("--out", help="write the head here instead of registering it")
    p.add_argument("--restart", action="store_true",
                   help="discard this target's earlier data and checkpoint")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(handler=_command)


def _command(args: argparse.Namespace) -> int:
    for name in ("max_new_tokens", "gen_batch", "draft_vocab", "epochs", "depth",
                 "batch_tokens"):
        if getattr(args, name) < 1:
            raise SpecdeckError(f"--{name.replace('_', '-')} must be >= 1 "
                                f"(got {getattr(args, name)})")
    if not args.lr > 0:
        raise SpecdeckError(f"--lr must be > 0 (got {args.lr})")
    summary = run(args.target, args.prompts or list(DEFAULT_PROMPTS), limit=args.limit,
                  out=args.out, restart=args.restart, max_new_tokens=args.max_new_tokens,
                  gen_batch=args.gen_batch, draft_vocab=args.draft_vocab, device=args.device,
                  dtype=args.dtype, epochs=args.epochs, lr=args.lr, depth=args.depth,
                  batch_tokens=args.batch_tokens)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"head: {summary['folder']}")
    if "pair" in summary:
        print(f"pair: {summary['pair']} (listed by `specdeck models`)")
    print(f"{summary['prompts']} prompts, {summary['tokens']} tokens "
          f"({summary['answer_tokens']} answered), {summary['seconds']:.0f} s; "
          f"{accuracy_line(summary)}")
    return 0


def accuracy_line(summary: dict[str, Any]) -> str:
    """Held-out top-1 per depth, teacher-forced and as a greedy chain (what drafting gets)."""
    def row(key: str) -> str:
        return " ".join(f"{a:.2f}" for a in summary[key])
    return (f"held-out top-1 by depth {row('held_out_accuracy')}; as a chain "
            f"{row('held_out_chain_accuracy')} (tau {summary['held_out_tau']:.2f})")
