"""Rewinding what a transformers DynamicCache keeps beside full-attention KV: a sliding
window's keys, a recurrent layer's (Gated DeltaNet, Mamba-2) conv input and state.

Built on transformers 5's past recording (`activate_past_recording`, cache_utils.py) rather
than a copy of its own: with it on, a sliding layer keeps every key until `crop`; a
linear-attention layer keeps its whole conv input, and the model's own forward computes the
recurrent state after each of the last `recurrent_states_to_keep` rows (one recurrent step per
row, the step a 1-row decode takes) and hands them to the cache. `crop(-r)` then selects the
state after row n - r: one state slot per verified position, chosen without a second forward
(issue 45's "state slots"). Every crop also commits: it drops what was recorded and trims the
window and the conv input back to what the next forward reads.

What is recorded is bounded here, per block of a forward (`prepare`): a forward of at most
MAX_VERIFY_ROWS rows (a verify, a drafter's step) keeps a slot per row; a longer one (a
prompt) commits before each block and keeps TAIL slots at its end. Below `floor` nothing is
recorded: `crop` answers False there and the session replays its tokens.

Knows: transformers' cache layer classes and their recording fields. Must not know: sessions'
token ids or padding, drafting, the model.
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import Cache, DummyLayer, LinearAttentionCacheLayerMixin

from backends.torch.attention import MAX_ROWWISE_ROWS

MAX_VERIFY_ROWS = MAX_ROWWISE_ROWS  # forwards up to this size rewind to any of their rows
TAIL = 2  # slots at the end of a longer forward: a drafter re-reads its last row


class PastRecorder:
    """Past recording on one cache: what a forward keeps, how far a crop may reach."""

    def __init__(self, cache: Cache) -> None:
        self._layers = [layer for layer in cache.layers if not isinstance(layer, DummyLayer)]
        self._recurrent = [layer for layer in self._layers
                           if isinstance(layer, LinearAttentionCacheLayerMixin)]
        for layer in self._layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        for layer in self._recurrent:
            # one list per state: transformers' dict.fromkeys shares a single list among them
            layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}
        self.floor = 0  # the shortest length a crop reaches without a replay

    @property
    def length(self) -> int:
        return max((int(layer.get_seq_length()) for layer in self._layers), default=0)

    def prepare(self, length: int, rows: int, forward_rows: int, last: bool) -> None:
        """Before a block of `rows` rows at `length`, of a forward of `forward_rows` rows
        (`last`: its final block): how many per-row states the block keeps."""
        kept = rows if forward_rows <= MAX_VERIFY_ROWS else (min(rows, TAIL) if last else 0)
        if kept < rows:
            # the history would skip rows: commit what came before, record from here
            self.crop(length)
            self.floor = length + rows - max(kept - 1, 0)
        for layer in self._recurrent:
            layer.recurrent_states_to_keep = kept

    def crop(self, length: int) -> bool:
        """Cut every layer to `length` tokens and commit; False (nothing cut) below floor."""
        if length < self.floor:
            return False
        for layer in self._layers:
            extra = int(layer.get_seq_length()) - length
            if extra >= 0 and _holds_state(layer):
                layer.crop(-extra)  # crop(0) commits: it trims what was recorded
        self.floor = length
        return True


def _holds_state(layer: Any) -> bool:
    """Whether a layer has seen a forward (crop reads its tensors)."""
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return any(layer.is_conv_states_initialized.values())
    return bool(layer.is_initialized)


def recorder_for(cache: Cache) -> PastRecorder | None:
    """A recorder where some layer keeps more than full-attention KV (a window, a state)."""
    if any(hasattr(layer, "activate_past_recording") for layer in cache.layers):
        return PastRecorder(cache)
    return None
