"""The contracts between the engine and an array library.

Knows: what the engine needs from a loaded model (Model), from its KV cache (Session), and
from a drafter (Drafter), which reads each forward through a StepFeed (app/core/feed.py);
what a backend can do (Capabilities) and which drafter kinds its own code builds (Runs);
TargetOutput (app/core/output.py) is re-exported here. Must not know: torch, mlx,
transformers. Adapters in backends/ implement these protocols; the engine in
app/core/engine.py consumes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from app.core.feed import StepFeed
from app.core.output import TargetOutput
from app.core.types import Draft, SamplingParams


@dataclass(frozen=True)
class Capabilities:
    """What a loaded model's session supports; checked at load, never discovered mid-run."""

    rewind: bool = True  # KV is cut; a window or a recurrent state needs its past recorded
    hidden_states: bool = False  # can capture chosen layers' hidden states for heads
    tree_attention: bool = False  # Session.forward takes `parents` (tree drafts)
    reason: str = ""  # why a capability is missing, named in refusals


@dataclass(frozen=True)
class Runs:
    """What one backend declares it runs, known without importing its array library: the
    drafter kinds its own code builds (a draft model, heads, own layers; kinds that need
    nothing run everywhere) and what its targets give (a loaded target's own capabilities
    take precedence). app/drafters/kinds.py checks a kind against it."""

    backend: str
    builds: frozenset[str]
    capabilities: Capabilities
    head_trees: bool = True  # its heads draft EAGLE-2 trees when asked (--tree)


@dataclass(frozen=True)
class DrafterRequest:
    """What a backend's builder of one kind is given: the target and what the user gave for
    the drafter (a draft model, a head folder, trees, a vocabulary limit)."""

    kind: str
    target: Any
    draft: Any = None
    head: str | None = None
    tree: bool = False
    vocab_limit: int = 0


@runtime_checkable
class Session(Protocol):
    """One KV cache over one token sequence. Lengths are absolute token counts.

    The session knows the ids it holds (`tokens`), so nobody keeps a mirror of its cache.
    """

    @property
    def length(self) -> int: ...

    @property
    def tokens(self) -> tuple[int, ...]: ...

    def forward(self, token_ids: Sequence[int], n_logits: int = 1,
                parents: Sequence[int] | None = None,
                capture: Sequence[int] = ()) -> TargetOutput:
        """Append token_ids; return rows for the last n_logits inputs.

        parents (tree drafts, where capabilities.tree_attention): per input row, the index of
        the row it follows, -1 for the cache's last token; the backend derives positions
        (length + depth) and the ancestor mask. capture: layers whose hidden states this
        forward returns.
        """
        ...

    def keep(self, length: int, rows: Sequence[int]) -> None:
        """After a forward that appended rows at [length, ...), keep only `rows`, in order.

        A chain keeps a prefix (rows 0..m, the same as rewind(length + m + 1)); a tree keeps
        one path. Absolute, like rewind.
        """
        ...

    def rewind(self, length: int) -> None:
        """Cut the cache to exactly `length` tokens (absolute, never relative)."""
        ...


@dataclass(frozen=True)
class ForwardCall:
    """One session's forward as a scheduler gathers them (batched streams): Session.forward's
    arguments, for the session that asked. model: the model the session runs, where it is
    not the target's (a draft model's forward, batched with other streams' drafts)."""

    session: Session
    token_ids: tuple[int, ...]
    n_logits: int = 1
    parents: tuple[int, ...] | None = None
    capture: tuple[int, ...] = ()
    model: Any = None

    def run(self) -> TargetOutput:
        """The call alone, on its own session."""
        return self.session.forward(self.token_ids, self.n_logits, self.parents, self.capture)


@dataclass(frozen=True)
class Forwarded:
    """A ForwardCall's answer, sent back into the generation that yielded it: the output,
    the forward's seconds and its rows (a batched forward's: every stream's)."""

    out: TargetOutput
    seconds: float
    rows: int


@runtime_checkable
class BatchForward(Protocol):
    """A model that runs several of its sessions' forwards as one (batched streams): each
    call gets what its session's own forward gives, and every session advances as it would."""

    def forward_batch(self, calls: Sequence[ForwardCall]) -> list[TargetOutput]: ...


class Tokenizer(Protocol):
    """The slice of an HF-style tokenizer the app uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@runtime_checkable
class Model(Protocol):
    """A loaded causal LM with its tokenizer."""

    name: str
    tokenizer: Any
    vocab_size: int  # rows of the output layer (may include padding)
    eos_token_ids: frozenset[int]
    context_length: int
    capabilities: Capabilities
    device: str
    dtype: str

    def start(self, capture_layers: Sequence[int] = (), exact: bool = True) -> Session:
        """A new session. exact=False lets a drafter skip whatever keeps the target's numerics
        independent of the row count (it costs time, and drafts need no exactness)."""
        ...

    def weights_bytes(self) -> int: ...

    def peak_memory_bytes(self) -> int:
        """Peak memory of the device this model runs on (process RSS peak on CPU)."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens; told the outcome of each verification.

    Lifecycle: begin(prompt, feed, params, rng) with the prefill's feed, then per step
    propose(context, k) -> Draft (a chain, or a tree no deeper than k) and accept(feed) with
    the verify's. The engine captures `capture_layers` on every target forward this drafter's
    steps run; a feed carries their hidden states at the rows the engine kept.
    """

    name: str
    capture_layers: tuple[int, ...]  # target layers whose hidden states `accept` needs

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: np.random.Generator) -> None: ...

    def propose(self, context: Sequence[int], k: int) -> Draft: ...

    def accept(self, feed: StepFeed) -> None: ...


@runtime_checkable
class Members(Protocol):
    """A drafter made of members tried in order (a chain): the k controller prices each on
    its own, one controller a member."""

    members: tuple[Drafter, ...]


@runtime_checkable
class ReadsContext(Protocol):
    """A drafter that must read context rows before it drafts (a draft model catching up):
    the k controller counts those rows in its cost."""

    def unread_rows(self, context: Sequence[int]) -> int: ...


@runtime_checkable
class VocabViews(Protocol):
    """A session whose output layer has lighter views, its own, for drafting: a cheaper head
    (its logits only propose) and a vocabulary cut to the given ids."""

    def lighten_head(self) -> None: ...

    def restrict_vocab(self, token_ids: Sequence[int] | None) -> None: ...


class Recorder(Protocol):
    """Where finished replies go (the history a suffix drafter drafts from), per partition
    (an API key's, or "local"). Called once per reply, before its Done: it must be quick."""

    def record(self, partition: str, prompt: Sequence[int], output: Sequence[int]) -> None: ...


class NoDrafter:
    """Plain decoding: the same engine loop with a drafter that proposes nothing."""

    name = "none"
    capture_layers: tuple[int, ...] = ()

    def begin(self, prompt_ids: Sequence[int], feed: StepFeed, params: SamplingParams,
              rng: np.random.Generator) -> None:
        return None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return Draft()

    def accept(self, feed: StepFeed) -> None:
        return None


def collect_eos_ids(*sources: Any) -> frozenset[int]:
    """Every end-of-sequence id the sources declare (an id, a list of ids or None each)."""
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)


class Backend(Protocol):
    """An array library adapter: loads models and builds the drafters its own code holds (the
    drafter factory in app/drafters asks it for them, by kind)."""

    name: str
    runs: Runs

    def load(self, path: str, device: str = "auto", dtype: str = "auto") -> Model: ...

    def make_drafter(self, kind: str, target: Model, *, draft: Model | None = None,
                     head: str | None = None, tree: bool = False, vocab_limit: int = 0
                     ) -> Drafter:
        """The drafter of a kind in `runs.builds` for target: a draft model's ("draft"), a
        head's from its folder, the target's own layers'; SpecdeckError with the one check's
        message (app/drafters/kinds.py) where it cannot."""
        ...
