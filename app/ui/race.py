"""The Race tab: plain decoding and speculative decoding side by side, timed honestly.

Knows: how to interleave two engine generators on one device step by step, timing each
side's own compute only (the time spent inside its own `next`), and how to judge the result
(speedup, τ, and for greedy whether the outputs are identical or where they first differ).
Must not know: array libraries, how engines are built (the Workbench hands them over).
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from app.core.prompt import chat_ids
from app.core.types import Done, SamplingParams, SpecdeckError, Step
from app.ui.chat import k_control, notice, session_of
from app.ui.inputs import RACE_MAX_NEW, TEMPERATURE, parse_k, sampling_from
from app.ui.render import Reply, escape_verbatim, friendly_error, legend_html, refusal, reply_html
from app.ui.workbench import DRAFTER_CHOICES, Workbench


@dataclass
class Lane:
    """One side of the race: its generator, its reply and the compute time it used."""

    name: str
    events: Iterator[Any]
    reply: Reply
    own_s: float = 0.0  # seconds spent inside this lane's own steps
    first_s: float = 0.0  # own seconds up to the first token (prefill)
    steps: int = 0
    finished: bool = False
    tokens: list[int] = field(default_factory=list)

    def advance(self) -> None:
        """Run one engine step of this lane and time it."""
        t0 = time.perf_counter()
        try:
            event = next(self.events)
        except StopIteration:
            self.finished = True
            return
        finally:
            self.own_s += time.perf_counter() - t0
        if isinstance(event, Step):
            self.reply.add(event)
            self.steps += 1
            if self.steps == 1:
                self.first_s = self.own_s
        elif isinstance(event, Done):
            self.reply.finish(event)
            self.finished = True

    @property
    def n_tokens(self) -> int:
        return len(self.reply.token_ids)

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first one per own second after the first one (prefill excluded)."""
        decode = self.own_s - self.first_s
        return (self.n_tokens - 1) / decode if decode > 0 and self.n_tokens > 1 else 0.0


def race(plain: Any, spec: Any, prompt_ids: list[int], params: SamplingParams,
         cancel: Any = None) -> Iterator[tuple[Lane, Lane]]:
    """Interleave the two generations; yield both lanes after every step.

    The lane that has used less compute goes next, so at any moment both have had about the
    same time on the device and the page shows the true difference in speed.
    """
    if plain is spec:
        raise SpecdeckError("the race needs two engines: pick a drafter other than none")
    lanes = (Lane("plain", plain.generate(prompt_ids, params, cancel=cancel),
                  Reply(plain.target.tokenizer)),
             Lane("speculative", spec.generate(prompt_ids, params, cancel=cancel),
                  Reply(spec.target.tokenizer)))
    try:
        while not all(lane.finished for lane in lanes):
            lane = min((la for la in lanes if not la.finished), key=lambda la: la.own_s)
            lane.advance()
            yield lanes
    finally:
        for lane in lanes:
            lane.events.close()


def verdict(plain: Lane, spec: Lane, greedy: bool) -> str:
    """The race's outcome in words: speedup, τ, and whether the outputs agree."""
    a, b = plain.reply.token_ids, spec.reply.token_ids
    stats = spec.reply.stats
    tau = stats.mean_accepted_length if stats else 1.0
    acceptance = stats.acceptance_rate if stats else 0.0
    speedup = spec.decode_tok_s / plain.decode_tok_s if plain.decode_tok_s > 0 else 0.0
    lines = [f"**Speedup {speedup:.2f}×** (decode: plain {plain.decode_tok_s:.1f} tok/s, "
             f"speculative {spec.decode_tok_s:.1f} tok/s, each timed on its own compute) · "
             f"τ {tau:.2f} · acceptance {acceptance:.0%}"]
    failed = [f"{lane.name}: {friendly_error(lane.reply.done.error or '')}"
              for lane in (plain, spec) if _reason(lane) == "error"]
    if failed:
        lines += failed
    elif not greedy:
        lines.append("Sampling: the two outputs are different draws from the same "
                     "distribution, so they are not compared token by token.")
    elif a == b:
        lines.append(f"✓ **Identical outputs**: all {len(a)} tokens match (greedy, lossless).")
    else:
        lines.append(_difference(plain, spec))
    stopped = [lane.name for lane in (plain, spec) if _reason(lane) == "cancelled"]
    if stopped:
        lines.append(f"Stopped early: {', '.join(stopped)}.")
    return "\n\n".join(lines)


def _difference(plain: Lane, spec: Lane) -> str:
    a, b = plain.reply.token_ids, spec.reply.token_ids
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i == min(len(a), len(b)):
        return (f"Outputs agree on the first {i} tokens; one side is longer ({len(a)} plain vs "
                f"{len(b)} speculative tokens), because it stopped or hit a limit.")
    tokenizer = plain.reply.tokenizer
    shown = [escape_verbatim(repr(tokenizer.decode([t]))) for t in (a[i], b[i])]
    return (f"✗ **Outputs differ at token {i}**: plain {shown[0]} vs speculative {shown[1]}. "
            "In fp32 this would be a bug; in bf16/fp16 a batched verify forward can round a "
            "near-tie differently from a one-token forward.")


def _reason(lane: Lane) -> str | None:
    return lane.reply.done.stop_reason if lane.reply.done else None


def lane_stats(lane: Lane, label: str) -> str:
    stats = lane.reply.stats
    tau = f" · τ {stats.mean_accepted_length:.2f}" if stats and stats.drafted else ""
    state = "done" if lane.finished else "running"
    return (f'<div class="sd-lane-stats" data-lane="{lane.name}" data-state="{state}">'
            f'{html.escape(label)} · {lane.n_tokens} tokens · {lane.steps} steps · '
            f'{lane.own_s:.2f} s own compute · {lane.decode_tok_s:.1f} tok/s{tau}</div>')


class RaceHandlers:
    """Event handlers of the Race tab, bound to one Workbench."""

    def __init__(self, bench: Workbench) -> None:
        self.bench = bench

    def run(self, prompt: str, as_chat: bool, drafter: str, k: str | int, max_new_tokens: float,
            temperature: float, seed: float | None, highlight: bool,
            request: gr.Request | None = None) -> Iterator[tuple]:
        """Yield (plain html, spec html, plain stats, spec stats, verdict, notice)."""
        try:
            # every control is checked before the model is taken
            params = sampling_from(temperature, 1.0, 0, 0.0, max_new_tokens, seed,
                                   max_new=RACE_MAX_NEW)
            k_value = parse_k(k)
            with self.bench.hold(session_of(request)) as cancel:
                plain, spec, label, ids = self._prepare(prompt, as_chat, drafter, k_value)
                yield from self._race(plain, spec, label, ids, params, cancel, highlight)
        except Exception as error:  # noqa: BLE001 - shown in the page; the model was released
            text = refusal(error)
            gr.Warning(text)
            yield (gr.skip(),) * 5 + (notice(text),)

    def _race(self, plain: Any, spec: Any, label: str, ids: list[int], params: SamplingParams,
              cancel: Any, highlight: bool) -> Iterator[tuple]:
        last, lanes = 0.0, None
        frames = race(plain, spec, ids, params, cancel)
        try:
            for lanes in frames:
                if time.perf_counter() - last >= 0.05:
                    last = time.perf_counter()
                    yield self._frame(lanes, label, highlight, "racing…")
            if lanes is not None:
                yield self._frame(lanes, label, highlight, verdict(*lanes, params.greedy))
        finally:
            frames.close()

    def _prepare(self, prompt: str, as_chat: bool, drafter: str, k: int | str) -> tuple:
        if not (prompt or "").strip():
            raise SpecdeckError("the prompt is empty: type something to race on")
        spec, choice = self.bench.engine(drafter, k)
        if choice.kind == "none":
            raise SpecdeckError("pick a drafter (auto, ngram or draft) to race against plain "
                                "decoding")
        plain, _ = self.bench.engine("none", 1, lane="race-plain")
        tokenizer = plain.target.tokenizer
        if as_chat and getattr(tokenizer, "chat_template", None):
            ids = chat_ids(tokenizer, [{"role": "user", "content": prompt}])
        else:
            ids = list(tokenizer.encode(prompt))
        plain.check_prompt(ids)
        return plain, spec, f"speculative ({choice.kind}, k {spec.k})", ids

    def _frame(self, lanes: tuple[Lane, Lane], label: str, highlight: bool, result: str) -> tuple:
        plain, spec = lanes
        return (reply_html(plain.reply.segments, highlight=False),
                reply_html(spec.reply.segments, highlight=highlight),
                lane_stats(plain, "plain (target alone)"), lane_stats(spec, label), result,
                notice(""))


def build_race_tab(bench: Workbench, stop_handler: Any) -> RaceHandlers:
    """Lay out the Race tab and wire its events; call inside a gr.Blocks context."""
    handlers = RaceHandlers(bench)
    gr.Markdown("One prompt, two generations on the same device, interleaved step by step. "
                "Each side is timed on its own compute only, so the speedup is honest.")
    with gr.Row():
        prompt = gr.Textbox(label="Prompt", lines=3, scale=4, elem_id="race-prompt",
                            value="Write a Python function that checks whether a string is a "
                                  "palindrome, then explain it.")
        with gr.Column(scale=1):
            drafter = gr.Dropdown([c for c in DRAFTER_CHOICES if c != "none"], value="auto",
                                  label="Drafter", elem_id="race-drafter")
            k = k_control(bench.default_k, "race-k")
            max_new = gr.Slider(16, RACE_MAX_NEW.high, value=128, step=16,
                                label=RACE_MAX_NEW.label, elem_id="race-max-new")
    with gr.Row():
        as_chat = gr.Checkbox(True, label="Wrap in the chat template")
        temperature = gr.Slider(TEMPERATURE.low, TEMPERATURE.high, value=0, step=0.05,
                                label="temperature (0 = greedy)")
        seed = gr.Number(-1, label="seed (-1 = random)", precision=0)
        highlight = gr.Checkbox(True, label="Highlight accepted draft tokens")
    with gr.Row():
        start = gr.Button("Race", variant="primary", elem_id="race-start")
        stop = gr.Button("Stop", variant="stop", elem_id="race-stop")
    race_notice = gr.HTML("", elem_id="race-notice")
    with gr.Row(equal_height=True):
        with gr.Column():
            plain_stats = gr.HTML(elem_id="race-plain-stats")
            plain_out = gr.HTML(elem_id="race-plain", elem_classes=["sd-lane"])
        with gr.Column():
            spec_stats = gr.HTML(elem_id="race-spec-stats")
            spec_out = gr.HTML(elem_id="race-spec", elem_classes=["sd-lane"])
    gr.HTML(legend_html())
    result = gr.Markdown(elem_id="race-verdict")
    start.click(handlers.run, [prompt, as_chat, drafter, k, max_new, temperature, seed, highlight],
                [plain_out, spec_out, plain_stats, spec_stats, result, race_notice],
                concurrency_id="model", concurrency_limit=1, show_progress="hidden")
    stop.click(stop_handler, None, None, queue=False)
    return handlers
