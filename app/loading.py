"""From command-line style settings to a ready SpecEngine: backend, target, drafter, prompt.

Knows: how --target/--drafter/--draft/--k/--backend/--device/--dtype combine, the chat
template. Must not know: array libraries (backends do the loading), the step loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.engine import SpecEngine
from app.ngram import NgramDrafter
from app.types import SpecdeckError
from backends import load_backend


@dataclass(frozen=True)
class Loaded:
    engine: SpecEngine
    drafter_name: str
    backend_name: str


def load_engine(args: Any) -> Loaded:
    """Build the engine the flags describe; every user mistake raises SpecdeckError."""
    if args.k < 0:
        raise SpecdeckError(f"--k must be >= 0 (got {args.k})")
    if not args.target:
        raise SpecdeckError("give a target model with --target PATH (HF folder or .gguf)")
    drafter_kind = args.drafter
    if drafter_kind == "draft" and not args.draft:
        raise SpecdeckError("--drafter draft needs --draft PATH (a small model of the same family)")
    if drafter_kind == "auto":
        drafter_kind = "draft" if args.draft else "ngram"
    backend = load_backend(args.backend)
    target = backend.load(args.target, device=args.device, dtype=args.dtype)
    if drafter_kind == "none" or args.k == 0:
        drafter, name = None, "none"
    elif drafter_kind == "ngram":
        drafter, name = NgramDrafter(), "ngram"
    else:
        draft = backend.load(args.draft, device=args.device, dtype=args.dtype)
        drafter, name = backend.draft_model_drafter(target, draft), "draft"
    engine = SpecEngine(target, drafter, k=args.k)
    return Loaded(engine=engine, drafter_name=name, backend_name=backend.name)


def encode_prompt(tokenizer: Any, text: str, chat: bool = False,
                  system: str | None = None) -> list[int]:
    """Token ids of the prompt; with chat, through the tokenizer's own chat template."""
    if not chat:
        return list(tokenizer.encode(text))
    if not getattr(tokenizer, "chat_template", None):
        raise SpecdeckError("this model's tokenizer has no chat template: drop --chat")
    messages = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": text})
    return chat_ids(tokenizer, messages)


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation, ending with the assistant's turn opened."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
