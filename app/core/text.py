"""Incremental detokenization for streaming: text deltas that never split a UTF-8 character.

Knows: a tokenizer's decode(). Must not know: models or the engine. Byte-level BPE can
spend several tokens on one character; until it is complete, decode() ends in U+FFFD and
the delta is held back. The previous chunk is decoded as context so that tokenizers which
drop a leading space at the start of a decode still produce the right delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids as they are committed; get back the text they add."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens whose text has been emitted
        self.text = ""

    def push(self, ids: Sequence[int]) -> str:
        """Add committed ids; return the new complete text (possibly empty)."""
        self._ids.extend(int(i) for i in ids)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if after.endswith(_REPLACEMENT) or len(after) <= len(before):
            return ""
        delta = after[len(before):]
        # the chunk just emitted becomes the context window for the next decode
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back, replacement characters included (end of stream)."""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        self._read = len(self._ids)
        delta = after[len(before):] if after.startswith(before) else ""
        self.text += delta
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip) if ids else ""
