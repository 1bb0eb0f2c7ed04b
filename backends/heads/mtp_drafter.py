"""Native MTP drafting, written once for every backend over the array adapter of
backends/arrays: the target's own MTP layer chained for k argmax drafts over its own cache.

Knows: the Drafter protocol and its StepFeeds, which pairs the MTP layer reads at which
positions, the recycle of its output state, the cache keeping committed pairs only (HEADS.md
§4). Must not know: an array library, the layer's computation and its cache (a backend's
step: `run(states, embeds, first_position)` -> [rows, H] after the out norm, appending the
rows to its cache at positions first_position..; `trim(n)` drops its last n rows; `length`;
`reset()` empties it), the checkpoint format (backends/heads/mtp_format.py), verification,
the engine's loop.

The MTP layer reads the target's final hidden state after its final norm at position t with
the embedding of token t + 1, at position t + 1, and predicts token t + 2. After each verify
it reads the feed's rows (the pending token's and the accepted tokens'), each paired with the
token after it. For k > 1 it runs again on its own out-norm state (recycled as vLLM and SGLang
do) with the token it just drafted; those rows leave the cache after the chain. Drafts are
argmax (q one-hot), so sampled verification stays exact; the chain's tokens stay on the
device and are read back once per propose.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from app.core.protocols import StepFeed
from app.core.types import Draft, SamplingParams
from backends.arrays import Arrays


class MtpDrafter:
    """Chains the first MTP layer for k draft tokens (a checkpoint with several MTP layers
    drafts with the first only: the others would need caches of their own fed with the first
    one's outputs).

    step: a backend's MTP step (above); embed, final_norm: the target's input embedding and
    final norm; lm_head: the layer's own output layer or the target's; capture_layer: the
    target's last layer, whose output the final norm turns into the state the layer reads.
    """

    name = "mtp"

    def __init__(self, step: Any, arrays: Arrays, *, embed: Callable[[Any], Any],
                 final_norm: Callable[[Any], Any], lm_head: Callable[[Any], Any],
                 capture_layer: int) -> None:
        self.step, self.arrays = step, arrays
        self.embed, self.final_norm, self.lm_head = embed, final_norm, lm_head
        self.capture_layers = (capture_layer,)
        self._begun = False
        self._last: Any = None  # out-norm state at the last committed pair

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: Any) -> None:
        # a prompt prefix the target reused from its cache is not re-read: the MTP cache
        # starts at the feed's first row (fewer keys to attend, still lossless)
        self.step.reset()
        self._begun, self._last = True, None
        self.accept(feed)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self._last is None or k < 1:
            return Draft()
        xp, step = self.arrays, self.step
        length, position = step.length, len(context)  # the pending state's next pair
        with xp.context():
            state = self._last
            token = self._argmax(state)
            tokens = [token]
            for _ in range(1, k):  # recycle the out-norm state with the token just drafted
                state = step.run(state[None], self.embed(token), position)[-1]
                position += 1
                token = self._argmax(state)
                tokens.append(token)
            drafted = xp.to_numpy(xp.concat(tokens))  # the chain's one host read
        step.trim(step.length - length)  # the cache keeps committed pairs only
        return Draft(tokens=tuple(int(t) for t in drafted.tolist()), source=self.name)

    def accept(self, feed: StepFeed) -> None:
        hidden = feed.hidden_states.get(self.capture_layers[0])
        if hidden is None or not self._begun:
            self._last = None
            return
        # each row pairs with the token after it (the next token for the last row, which a
        # sampled first token need not be the argmax of); the last pair drafts the next token
        xp = self.arrays
        with xp.context():
            embeds = self.embed(xp.asarray(list(feed.following)))
            self._last = self.step.run(self.final_norm(hidden), embeds, feed.start + 1)[-1]
        xp.schedule(self._last)

    def _argmax(self, state: Any) -> Any:
        """The drafted token of an out-norm state, [1] on the device."""
        return self.arrays.argmax(self.lm_head(state[None]))[:, 0]
