"""From engine events to what the page shows: token provenance, reply HTML, stats cards, plots.

Knows: Step/Done/RunStats, the tokenizer's decode (through IncrementalDetokenizer), HTML
escaping. Must not know: Gradio, engines, models. Every function is pure or owns only its
accumulator, so handler tests check them without a browser.
"""

from __future__ import annotations

import html
import logging
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from app.core.text import IncrementalDetokenizer
from app.core.types import Done, DrafterStats, RunStats, SpecdeckError, Step

# provenance of a committed token (LANDSCAPE: per-token provenance, EAGLE's highlight)
KINDS = {
    "draft": "accepted draft token",
    "bonus": "bonus token (every draft accepted)",
    "recovered": "recovered token (target corrected a draft)",
    "target": "target token (nothing drafted)",
}
POSITIONS = [f"d{j}" for j in range(1, 65)]  # bar labels, in draft order
# characters markdown or KaTeX would act on, written as entities so tokens show verbatim
_ENTITIES = {c: f"&#{ord(c)};" for c in "\\`*_{}[]()#+-.!|~$<>&\"'="}


def token_kinds(step: Step) -> list[str]:
    """Provenance of each token of one step; accepted drafts lead, the target's token follows."""
    kinds = []
    for from_draft in step.from_draft:
        if from_draft:
            kinds.append("draft")
        elif step.n_drafted == 0:
            kinds.append("target")
        elif step.n_accepted == step.n_drafted:
            kinds.append("bonus")
        else:
            kinds.append("recovered")
    return kinds


@dataclass
class Reply:
    """Accumulates one reply: its text split into (text, kind) segments, and its token ids."""

    tokenizer: Any
    segments: list[tuple[str, str]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    stats: RunStats | None = None
    done: Done | None = None

    def __post_init__(self) -> None:
        # no tokenizer (a remote engine): the steps' own text, without per-token provenance
        self._detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.segments)

    def add(self, step: Step) -> None:
        self.stats = step.stats
        if self._detok is None:
            self._append(step.text, token_kinds(step)[0] if step.tokens else "target")
            return
        for token, kind in zip(step.tokens, token_kinds(step)):
            self.token_ids.append(int(token))
            self._append(self._detok.push([token]), kind)

    def finish(self, done: Done) -> None:
        """Flush held-back text; the engine's final text wins if the two ever disagree."""
        self._append(self._detok.flush() if self._detok else "", "target")
        self.done, self.stats = done, done.stats
        if self.text != done.text:
            self.segments = [(done.text, "target")]

    def _append(self, text: str, kind: str) -> None:
        if not text:
            return
        if self.segments and self.segments[-1][1] == kind:
            self.segments[-1] = (self.segments[-1][0] + text, kind)
        else:
            self.segments.append((text, kind))


def escape_verbatim(text: str) -> str:
    """HTML that shows `text` exactly, inside markdown: no emphasis, no links, no maths."""
    return "".join(_ENTITIES.get(c, c) for c in text).replace("\n", "<br>")


def reply_html(segments: list[tuple[str, str]], highlight: bool = True) -> str:
    """One line of spans (markdown keeps it a single paragraph); a class per provenance."""
    if not segments:
        return ""
    if not highlight:
        return "".join(escape_verbatim(text) for text, _ in segments)
    return "".join(f'<span class="sd-tok sd-{kind}">{escape_verbatim(text)}</span>'
                   for text, kind in segments)


def legend_html() -> str:
    items = "".join(f'<span class="sd-legend-item"><span class="sd-tok sd-{kind}">{kind}'
                    f'</span> {html.escape(label)}</span>' for kind, label in KINDS.items())
    return f'<div class="sd-legend">{items}</div>'


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# the RunStats names behind each card: a card whose source went unreported shows "?"
CARD_SOURCES = {"tok_s": ("decode_tok_s",), "tau": ("mean_accepted_length",),
                "acceptance": ("acceptance_rate",), "counts": ("accepted", "drafted"),
                "new_tokens": ("n_new_tokens",), "prompt": ("n_prompt_tokens",),
                "ttft": ("ttft_s",), "split": ("draft_s", "verify_s")}
CARD_STATS = frozenset(name for names in CARD_SOURCES.values() for name in names)


def _card(label: str, value: str, key: str, hint: str = "",
          unknown: frozenset[str] = frozenset()) -> str:
    if unknown.intersection(CARD_SOURCES.get(key, ())):
        value, hint = "?", "the engine did not report this"
    title = f' title="{html.escape(hint)}"' if hint else ""
    return (f'<div class="sd-card" data-stat="{key}"{title}><div class="sd-card-value">'
            f'{html.escape(value)}</div><div class="sd-card-label">{html.escape(label)}</div>'
            '</div>')


def stats_html(stats: RunStats | None, status: str, drafter: str = "", k: int = 0,
               memory: dict[str, int] | None = None,
               unknown: frozenset[str] = frozenset()) -> str:
    """The live stats panel: speed, τ, acceptance, counts, timing split and memory; cards
    whose RunStats names are in `unknown` (a remote engine did not report them) show "?"."""
    s = stats or RunStats()
    cards = [_card(*card, unknown=unknown) for card in _cards(s)]
    cards += [_member_card(member, s.target_forwards) for member in s.drafters]
    if memory:
        peak = max(memory.get("peak", 0), s.peak_memory_bytes)
        cards.append(_card("memory now (peak)", f"{human_bytes(memory['rss'])} "
                           f"({human_bytes(peak)})", "memory",
                           f"model weights {human_bytes(memory['weights'])}"))
    head = html.escape(f"{status}" + (f" · drafter {drafter}, k {k}" if drafter else "")
                       + _off_note(s))
    return (f'<div class="sd-stats"><div class="sd-status" data-status="{html.escape(status)}">'
            f'{head}</div><div class="sd-cards">{"".join(cards)}</div></div>')


def _off_note(s: RunStats) -> str:
    """Why k="auto" drafted nothing on some steps: it did not pay, or (batched streams) the
    other streams filled the forward, so draft rows would have cost the step its speed."""
    off, by_load = s.speculation_off_steps, s.load_off_steps
    if not off:
        return ""
    if by_load:
        return (f" · speculation off for {off} steps ({by_load} of them: {s.streams} streams "
                "fill the step)")
    return f" · speculation off for {off} steps (it did not pay)"


def _cards(s: RunStats) -> list[tuple[str, ...]]:
    """(label, value, key, hint) of the fixed cards."""
    return [
        ("decode tok/s", f"{s.decode_tok_s:.1f}", "tok_s",
         "tokens per second after the first token; prefill excluded"),
        ("τ accepted length", f"{s.mean_accepted_length:.2f}", "tau",
         "tokens committed per target forward, bonus included; plain decoding is 1.00"),
        ("acceptance", f"{s.acceptance_rate:.0%}", "acceptance",
         "accepted draft tokens / drafted tokens"),
        ("accepted / drafted", f"{s.accepted} / {s.drafted}", "counts"),
        ("new tokens", str(s.n_new_tokens), "new_tokens",
         f"{s.target_forwards} target forwards after the prefill"),
        ("prompt (cached)", f"{s.n_prompt_tokens} ({s.n_cached_prompt_tokens})", "prompt",
         "prompt tokens, and how many were reused from the cache"),
        ("first token", f"{s.ttft_s * 1000:.0f} ms", "ttft"),
        ("draft / verify / other", f"{s.draft_s:.2f} / {s.verify_s:.2f} / {s.other_s:.2f} s",
         "split"),
    ]


def _member_card(member: DrafterStats, target_forwards: int) -> str:
    # a chain's members apart: which one proposed what, and what each adds to τ
    share = member.to_dict(target_forwards)
    return _card(f"{member.name}: accepted / drafted",
                 f"{member.accepted} / {member.drafted} ({member.acceptance_rate:.0%})",
                 f"drafter-{member.name}",
                 f"{member.steps} drafts; adds {share['tau_contribution']:.2f} to τ")


def position_frame(stats: RunStats | None) -> pd.DataFrame:
    """Per-position acceptance as a bar chart's data: position j -> share accepted."""
    rates = stats.acceptance_per_position if stats else ()
    # typed columns even when empty: the chart's axis kinds are fixed by its first value
    return pd.DataFrame({"position": pd.Series(POSITIONS[:len(rates)], dtype="str"),
                         "acceptance": pd.Series([round(r, 3) for r in rates], dtype="float")})


def refusal(error: Exception) -> str:
    """What the page says about an error a handler raised: a SpecdeckError names its fix;
    anything else is a library failure or a bug, so its traceback goes to the log too."""
    if isinstance(error, SpecdeckError):
        return str(error)
    logging.getLogger("specdeck.ui").error("a handler failed", exc_info=error)
    return friendly_error(f"{type(error).__name__}: {error}")


def friendly_error(error: str) -> str:
    """An engine error as a sentence that names the fix."""
    lowered = error.lower()
    if "out of memory" in lowered or "outofmemory" in lowered or "memoryerror" in lowered:
        return ("out of memory while generating: clear the conversation, lower max new tokens, "
                f"pick drafter none, or load a smaller pair ({error})")
    return f"generation failed: {error}. The model is still loaded; try again or Clear."
