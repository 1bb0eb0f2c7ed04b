"""A numpy model for core tests: next-token logits are a fixed table over the last token.

Knows: the Model and Session protocols. Must not know: torch, mlx. Rewind is list
truncation and a tree row's logits depend only on its own token, so engine, stop rules, the k
controller and tree verification run in milliseconds (nanochat's MockModel does the same).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.core.protocols import Capabilities, TargetOutput


class CharTokenizer:
    """Token i is the character chr(97 + i % 26)."""

    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - 97 for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {chr(97 + i): i for i in range(26)}


class FakeSession:
    def __init__(self, model: FakeModel) -> None:
        self._model = model
        self._ids: list[int] = []
        self.prompt_tokens_read = 0  # every token a forward appended, for reuse claims

    @property
    def length(self) -> int:
        return len(self._ids)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def forward(self, token_ids: Sequence[int], n_logits: int = 1,
                parents: Sequence[int] | None = None,
                capture: Sequence[int] = ()) -> TargetOutput:
        ids = [int(t) for t in token_ids]
        self._ids.extend(ids)
        self.prompt_tokens_read += len(ids)
        logits = self._model.table[ids[len(ids) - n_logits:]].astype(np.float32)
        return TargetOutput(argmax=tuple(int(i) for i in logits.argmax(-1)),
                            logits_fn=lambda: logits,
                            hidden_states={i: logits for i in capture})

    def keep(self, length: int, rows: Sequence[int]) -> None:
        self._ids[length:] = [self._ids[length + r] for r in rows]

    def rewind(self, length: int) -> None:
        del self._ids[length:]


class FakeModel:
    """logits(next | last token t) = table[t]; a random table unless one is given."""

    def __init__(self, vocab: int = 8, seed: int = 0, table: np.ndarray | None = None,
                 eos: int | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.table = table if table is not None else rng.normal(0, 2, (vocab, vocab))
        self.vocab_size = self.table.shape[1]
        self.name, self.device, self.dtype = "fake", "cpu", "float32"
        self.tokenizer = CharTokenizer()
        self.eos_token_ids = frozenset() if eos is None else frozenset({eos})
        self.context_length = 4096
        self.capabilities = Capabilities(rewind=True, hidden_states=True, tree_attention=True)
        self.sessions: list[FakeSession] = []

    def start(self, capture_layers: Sequence[int] = (), exact: bool = True) -> FakeSession:
        self.sessions.append(FakeSession(self))
        return self.sessions[-1]

    def weights_bytes(self) -> int:
        return int(self.table.nbytes)

    def peak_memory_bytes(self) -> int:
        return 0


class RecordingDrafter:
    """A drafter with every draft it proposes kept (`drafts`; `blocks`: their tokens)."""

    def __init__(self, inner) -> None:
        self.inner, self.drafts = inner, []
        self.name, self.capture_layers = inner.name, inner.capture_layers

    @property
    def blocks(self) -> list[list[int]]:
        return [list(d.tokens) for d in self.drafts]

    def begin(self, *args) -> None:
        self.inner.begin(*args)

    def propose(self, context, k):
        draft = self.inner.propose(context, k)
        self.drafts.append(draft)
        return draft

    def accept(self, feed) -> None:
        self.inner.accept(feed)
