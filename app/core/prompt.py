"""A prompt's token ids: the text as it is, or a conversation through the tokenizer's own chat
template, ending with the assistant's turn opened.

Knows: a tokenizer's encode() and apply_chat_template(). Must not know: models, backends or
where the text came from (a leaf: the CLI, bench, the server, the UI and head training build
prompts here).
"""

from __future__ import annotations

from typing import Any

from app.core.types import SpecdeckError


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
