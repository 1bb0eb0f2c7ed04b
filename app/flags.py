"""Flags that several commands share: the target and drafter a command loads, and their help.

Knows: argparse and the drafter kinds' names. Must not know: what a command does with them
(a leaf: `specdeck generate`, bench, serve and the UI each add these to their own parser).
"""

from __future__ import annotations

import argparse

from app import drafters
from app.store.history import DEFAULT_MAX_BYTES, DEFAULT_MAX_TOKENS

# every surface drafts with the planner's choice for the target, its k chosen per step from
# measured costs (k=auto turns drafting off where it does not pay)
DEFAULT_DRAFTER, DEFAULT_K = "auto", "auto"

DRAFT_VOCAB_HELP = ("draft only among the N lowest token ids (plus the prompt's tokens and "
                    "EOS): a cheaper output layer, lower acceptance; 0 = whole vocabulary")
DTYPE_HELP = ("auto, gguf (a .gguf's own blocks times int8 activations, as llama.cpp runs "
              "them; CPU), float32, bfloat16, float16, int8 (weight-only int8, bf16 "
              "activations), w8a8 (int8 weights and per-token int8 activations), int4 (4-bit "
              "weights, CPU) or w4a8 (4-bit weights, int8 activations per 32, CPUs with "
              "AVX512-VNNI); auto on CPU: gguf for a .gguf, else the fastest mode no coarser "
              "than the model file (--json says why)")
DRAFT_DTYPE_HELP = "dtype of the draft model (default: --dtype); int8 or w8a8 drafts cheaper on CPU"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a target and a drafter."""
    p.add_argument("--target", help="target model: HF folder, .gguf file or catalogue pair id")
    p.add_argument("--drafter", choices=drafters.CHOICES, default=DEFAULT_DRAFTER,
                   help="how draft tokens are proposed (none = plain decoding; auto, the "
                        "default: the planner's choice for the target, its reason printed)")
    p.add_argument("--draft", help="draft model (HF folder or .gguf) for --drafter draft, or "
                                   "the head folder for --drafter eagle3 / eagle")
    p.add_argument("--tree", action="store_true",
                   help="draft EAGLE-2 dynamic trees (--drafter eagle3 / eagle); k is the depth")
    p.add_argument("--k", type=k_value, default=DEFAULT_K,
                   help="draft tokens per step (num_draft_tokens), or auto (the default): "
                        "chosen per step from measured costs and acceptance")
    add_runtime_arguments(p)
    p.add_argument("--no-history", action="store_true",
                   help="neither record replies nor draft from past ones (the history is on "
                        "by default: SPECDECK_HOME/history, `specdeck cache clear` empties it)")
    add_history_bounds(p)


def add_history_bounds(p: argparse.ArgumentParser) -> None:
    """How much history is kept: `specdeck cache build` and the model commands."""
    p.add_argument("--history-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="tokens the history keeps per partition, the oldest evicted first "
                        "(default 1M)")
    p.add_argument("--history-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="bytes the history folder may take on disk (default 256 MB)")


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    """Where and in what dtype the models run: the model commands' flags, and bench's."""
    p.add_argument("--backend", default="auto",
                   help="auto, torch, mlx or llamacpp (a GGUF on llama.cpp's kernels)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda (torch) or gpu (mlx)")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--draft-dtype", default=None, help=DRAFT_DTYPE_HELP)
    p.add_argument("--draft-vocab", type=int, default=0, help=DRAFT_VOCAB_HELP)


def k_value(text: str) -> int | str:
    """--k: a whole number (validated later, with the fix named) or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        message = f"--k takes a whole number or auto (got {text!r})"
        raise argparse.ArgumentTypeError(message) from None
