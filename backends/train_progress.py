"""What a head's training reports while it runs.

Knows: the phases (answering prompts, training), tokens per second and the running top-1
accuracy per TTT depth, and the one-line text of each. Must not know: array libraries or
where the line is shown (a leaf: the trainer makes these records, the CLI and the UI show
them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainProgress:
    phase: str                  # "data", "train", "saved", "note"
    done: int                   # prompts answered / optimizer steps taken
    total: int
    tokens_per_s: float = 0.0
    loss: float = 0.0
    accuracy: tuple[float, ...] = ()  # running top-1 per depth (1-based in the text)
    epoch: int = 0
    message: str = ""

    def line(self) -> str:
        if self.phase in ("note", "saved"):
            return self.message
        bar = _bar(self.done, self.total)
        rate = f"{self.tokens_per_s:,.0f} tok/s"
        if self.phase == "data":  # no rate before a token is written (or all read back)
            return f"answering prompts {bar} {self.done}/{self.total}" + (
                f"  {rate}" if self.tokens_per_s > 0 else "")
        acc = " ".join(f"{a:.2f}" for a in self.accuracy)
        return (f"epoch {self.epoch} {bar} step {self.done}/{self.total}  {rate}  "
                f"loss {self.loss:.3f}  top-1 by depth {acc}")


ProgressFn = Callable[[TrainProgress], None]


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total) if total else width
    return "[" + "#" * filled + "." * (width - filled) + "]"
