"""Draft pair safety: a drafter must speak the target's vocabulary.

Knows: HF-style tokenizers (get_vocab, special tokens) and output-layer sizes. Must not
know: array libraries. A mismatch is refused at load with both models and the difference
named, because a drafter with other token ids would be accepted almost never, silently.
"""

from __future__ import annotations

from typing import Any

from app.core.types import SpecdeckError

MAX_PADDING_DIFFERENCE = 1024  # Qwen2.5-7B pads to 152064 rows, its 0.5B to 151936


def check_vocab_compatible(target: Any, draft: Any) -> None:
    """Raise SpecdeckError unless draft and target share token ids, texts and special tokens."""
    problem = _difference(target, draft)
    if problem:
        raise SpecdeckError(
            f"the drafter {draft.name} does not share the vocabulary of the target "
            f"{target.name}: {problem}. Pick a drafter of the same model family (same "
            "tokenizer), or use --drafter ngram")


def _difference(target: Any, draft: Any) -> str:
    gap = abs(target.vocab_size - draft.vocab_size)
    if gap > MAX_PADDING_DIFFERENCE:
        return f"output sizes {target.vocab_size} vs {draft.vocab_size}"
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if len(t_vocab) != len(d_vocab):
        return f"{len(t_vocab)} vs {len(d_vocab)} tokens in the tokenizers"
    differing = [tok for tok, i in t_vocab.items() if d_vocab.get(tok) != i]
    if differing:
        return f"{len(differing)} token texts map to other ids (e.g. {differing[0]!r})"
    t_special, d_special = _specials(target.tokenizer), _specials(draft.tokenizer)
    if t_special != d_special:
        return f"special tokens differ: {sorted(t_special ^ d_special)[:5]}"
    return ""


def _specials(tokenizer: Any) -> set[tuple[str, int]]:
    names = getattr(tokenizer, "all_special_tokens", [])
    ids = getattr(tokenizer, "all_special_ids", [])
    return set(zip(names, ids))
