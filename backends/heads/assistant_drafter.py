"""Gemma 4's assistant drafting, written once for every backend over the array adapter of
backends/arrays: a small drafter reading the target's own keys and values (transformers'
`gemma4_assistant`), chained for k argmax drafts.

Knows: the assistant's inputs as transformers' SinglePositionMultiTokenCandidateGenerator
feeds them: `cat(target embedding of the pending token, the target's final-norm state before
it)`, at the pending token's position, held for the whole chain; each later draft reads the
assistant's own projected state and the token it just drafted. `shared_kv_states`: per
attention type, the keys and values of the target's store layer over the committed positions
only, recomputed from each kept row's input to that layer (the previous layer's output,
captured), so the target's cache is never read and rejected rows never reach the assistant;
sliding types keep twice the window (the assistant's own read picks the last rows).
Must not know: an array library, the computations (a backend's step: `embed(tokens [n])` ->
[n, H]; `final_norm(rows [n, H])`; `keys_values(layer, rows [n, H], first_position)` -> the
store layer's (keys, values) [kv heads, n, head dim] at positions first_position..;
`run(inputs [1, 2H], position, shared)` -> (logits [1, vocab], projected state [1, H])),
the folder's format (backends/heads/assistant_format.py), verification, the engine's loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from app.core.protocols import StepFeed
from app.core.types import Draft, SamplingParams
from backends.arrays import Arrays

SLIDING = "sliding_attention"


class AssistantDrafter:
    """Chains the assistant for k argmax drafts from the target's committed keys and values.

    Drafts are argmax (q one-hot), so sampled verification stays exact; the chain's tokens
    stay on the device and are read back once per propose. stores: attention type -> the
    target's store layer (assistant_format.store_layers); window: the target's sliding
    window; last_layer: the target's last layer, whose output the final norm turns into the
    state the first draft reads."""

    name = "assistant"

    def __init__(self, step: Any, arrays: Arrays, *, stores: Mapping[str, int], window: int,
                 last_layer: int) -> None:
        self.step, self.arrays = step, arrays
        self._stores, self._window, self._last_layer = dict(stores), window, last_layer
        self.capture_layers = tuple(sorted({*(i - 1 for i in self._stores.values()),
                                            last_layer}))
        self._kv: dict[str, tuple[Any, Any] | None] = {}
        self._state: Any = None  # [1, H]: the final-norm state before the pending token

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: Any) -> None:
        # a prompt prefix reused from the target's cache is not re-read: the assistant then
        # attends to the feed's rows only (fewer keys, still lossless)
        self._kv = dict.fromkeys(self._stores)
        self._state = None
        self.accept(feed)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self._state is None or k < 1:  # a state is set only with every type's keys
            return Draft()
        xp, step = self.arrays, self.step
        position = len(context) - 1  # the pending token's, for the whole chain
        with xp.context():
            token, state, drafted = xp.asarray([int(context[-1])]), self._state, []
            for _ in range(k):
                inputs = xp.concat([step.embed(token), state], axis=-1)
                logits, state = step.run(inputs, position, self._kv)
                token = xp.argmax(logits)[:, 0]
                drafted.append(token)
            chain = xp.to_numpy(xp.concat(drafted))  # the chain's one host read
        return Draft(tokens=tuple(int(t) for t in chain.tolist()), source=self.name)

    def accept(self, feed: StepFeed) -> None:
        hidden = feed.hidden_states
        if any(layer not in hidden for layer in self.capture_layers) or not self._kv:
            self._state = None
            return
        xp = self.arrays
        with xp.context():
            for kind, index in self._stores.items():
                keys, values = self.step.keys_values(index, hidden[index - 1], feed.start)
                self._kv[kind] = self._appended(kind, keys, values)
            self._state = self.step.final_norm(hidden[self._last_layer][-1:])
        xp.schedule(self._state, *(part for kv in self._kv.values() for part in kv or ()))

    def _appended(self, kind: str, keys: Any, values: Any) -> tuple[Any, Any]:
        held = self._kv.get(kind)
        if held is not None:
            keys = self.arrays.concat([held[0], keys], axis=1)
            values = self.arrays.concat([held[1], values], axis=1)
        if kind == SLIDING and self._window:
            # twice the window: the assistant's own read picks the last rows it attends to
            # (the last window + 1 in transformers 5.25), whatever that count
            keys, values = keys[:, -2 * self._window:], values[:, -2 * self._window:]
        return keys, values
