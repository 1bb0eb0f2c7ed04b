"""The Chat tab: streaming multi-turn chat with live speculative stats and highlighted drafts.

Knows: the conversation as turns, the tokenizer's chat template (app.core.prompt.chat_ids), how
Step/Done events become page updates, Stop through the Workbench's per-session cancel flag.
Must not know: array libraries, how engines are built. Handlers are plain generators
(events in, component values out), tested without a browser in tests/test_ui.py.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterator
from typing import Any

import gradio as gr

from app import remote_flags
from app.core.prompt import chat_ids
from app.core.types import Done, SpecdeckError, Step
from app.ui.inputs import (
    CHAT_MAX_NEW,
    MIN_P,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    K,
    parse_k,
    sampling_from,
)
from app.ui.render import (
    CARD_STATS,
    POSITIONS,
    Reply,
    friendly_error,
    legend_html,
    position_frame,
    refusal,
    reply_html,
    stats_html,
)
from app.ui.workbench import DRAFTER_CHOICES, Workbench

UPDATE_EVERY_S = 0.05  # at most ~20 page updates a second; the last step always shows
STOPPED = ' <span class="sd-stopped">⏹ stopped</span>'
DEFAULT_SYSTEM = "You are a helpful assistant."
K_CHOICES = ["auto", *(str(k) for k in range(int(K.low), int(K.high) + 1))]

Turn = dict[str, Any]  # {"role", "content", "segments": [(text, kind)], "note"}


def k_control(default: int | str, elem_id: str) -> gr.Dropdown:
    return gr.Dropdown(K_CHOICES, value=str(default), label="k (draft tokens per step)",
                       allow_custom_value=True, elem_id=elem_id,
                       info="auto: chosen every step from measured costs and acceptance")


def conversation(system: str, turns: list[Turn], message: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system.strip() else []
    messages += [{"role": t["role"], "content": t["content"]} for t in turns]
    return messages + [{"role": "user", "content": message}]


def chatbot_value(turns: list[Turn], highlight: bool) -> list[dict[str, str]]:
    """Chatbot messages; assistant turns as token spans when highlighting, else markdown."""
    out = []
    for turn in turns:
        content = turn["content"]
        if turn["role"] == "assistant" and not content and not turn.get("note"):
            continue  # a reply that has not started yet
        if turn["role"] == "assistant" and highlight and turn.get("segments"):
            content = reply_html(turn["segments"]) + turn.get("note", "")
        elif turn["role"] == "assistant":
            content += turn.get("note", "")
        out.append({"role": turn["role"], "content": content})
    return out


def session_of(request: Any) -> str:
    return getattr(request, "session_hash", None) or "local"


class ChatHandlers:
    """Event handlers of the Chat tab, bound to one Workbench."""

    def __init__(self, bench: Workbench) -> None:
        self.bench = bench
        self.drafter_control: Any = None  # set once the tab is laid out
        self._clearing: set[str] = set()  # sessions whose running reply Clear interrupted

    def submit(self, message: str, turns: list[Turn], system: str, temperature: float,
               top_p: float, top_k: float, min_p: float, max_new_tokens: float,
               seed: float | None, drafter: str, k: str | int, highlight: bool,
               request: gr.Request | None = None) -> Iterator[tuple]:
        """Yield (chatbot, turns, stats, plot, notice, message box) as the reply streams."""
        turns = list(turns or [])
        session = session_of(request)
        try:
            # every control is checked before the model is taken
            if not (message or "").strip():
                raise SpecdeckError("the message is empty: type something to send")
            params = sampling_from(temperature, top_p, top_k, min_p, max_new_tokens, seed)
            k_value = parse_k(k)
            start = self.bench.start
            if start is not None and start.loading:  # the pair loading at start: wait for it
                yield (gr.skip(), turns, stats_html(None, f"waiting for {start.pair_id} to "
                                                    "load…"), gr.skip(), notice(""), gr.skip())
                start.wait()
            with self.bench.hold(session) as cancel:
                if self.bench.remote is not None:
                    engine, kind = self.bench.remote, self.bench.remote.drafter_name
                    # the server applies its own chat template; drafter and k are its own
                    events = engine.chat(conversation(system or "", turns, message), params,
                                         cancel)
                else:
                    engine, choice, prompt_ids = self._prepare(message, turns, system, drafter,
                                                               k_value)
                    kind = choice.kind
                    events = engine.generate(prompt_ids, params, cancel=cancel)
                yield from self._stream(engine, kind, events, message, turns, highlight)
                if session in self._clearing:  # Clear was pressed mid-reply: its view wins
                    yield self.clear() + ("",)
        except Exception as error:  # noqa: BLE001 - shown in the page; the model was released
            text = refusal(error)
            gr.Warning(text)
            yield (gr.skip(), turns, gr.skip(), gr.skip(), notice(text), gr.skip())
        finally:
            self._clearing.discard(session)

    def _prepare(self, message: str, turns: list[Turn], system: str, drafter: str,
                 k: int | str) -> tuple:
        engine, choice = self.bench.engine(drafter, k)
        try:
            prompt_ids = chat_ids(engine.target.tokenizer,
                                  conversation(system or "", turns, message))
        except Exception as error:  # noqa: BLE001 - transformers and jinja raise several kinds
            raise SpecdeckError(f"the chat template could not format this conversation "
                                f"({error}): load an instruct model, Clear the history, or use "
                                "the Race tab's plain prompt") from error
        engine.check_prompt(prompt_ids)
        return engine, choice, prompt_ids

    def _stream(self, engine: Any, kind: str, events: Iterator[Any], message: str,
                turns: list[Turn], highlight: bool) -> Iterator[tuple]:
        reply = Reply(getattr(engine.target, "tokenizer", None))
        turns = [*turns, {"role": "user", "content": message},
                 {"role": "assistant", "content": "", "segments": [], "note": ""}]
        # the message shows at once; the reply follows after the prompt is read (prefill)
        yield self._frame(turns, reply, "reading the prompt…", kind, engine.k, highlight, "")
        last = time.perf_counter()
        try:
            for event in events:
                if isinstance(event, Step):
                    reply.add(event)
                    if time.perf_counter() - last < UPDATE_EVERY_S:
                        continue
                    last = time.perf_counter()
                    yield self._frame(turns, reply, "generating…", kind, engine.k, highlight, "")
                elif isinstance(event, Done):
                    reply.finish(event)
        finally:
            events.close()  # a closed tab or an error here still runs the engine's finally
        yield self._final(turns, reply, kind, engine.k, highlight)

    def _frame(self, turns: list[Turn], reply: Reply, status: str, kind: str, k: int | str,
               highlight: bool, message_notice: str, note: str = "") -> tuple:
        turns = [*turns[:-1], {"role": "assistant", "content": reply.text,
                               "segments": list(reply.segments), "note": note}]
        remote = self.bench.remote
        if remote is not None:  # what the server did not report shows as "?", and why
            unknown = [name for name in remote_flags.unreported(remote, CARD_STATS)
                       if reply.done]
            stats = stats_html(reply.stats, f"{status} · {remote_flags.note(remote, unknown)}"
                               if unknown else status, kind, k, unknown=frozenset(unknown))
        else:
            stats = stats_html(reply.stats, status, kind, k, self.bench.memory())
        return (chatbot_value(turns, highlight), turns, stats, position_frame(reply.stats),
                notice(message_notice), "")

    def _final(self, turns: list[Turn], reply: Reply, kind: str, k: int | str,
               highlight: bool) -> tuple:
        done = reply.done
        if done is None:  # the engine ended without Done: treat as stopped
            return self._frame(turns, reply, "stopped", kind, k, highlight, "", STOPPED)
        if done.stop_reason == "error":
            text = friendly_error(done.error or "unknown error")
            gr.Warning(text)
            return self._frame(turns, reply, "error", kind, k, highlight, text)
        if done.stop_reason == "cancelled":
            return self._frame(turns, reply, "stopped", kind, k, highlight, "", STOPPED)
        status = {"eos": "done", "length": "done (max new tokens)"}.get(done.stop_reason,
                                                                        done.stop_reason)
        return self._frame(turns, reply, status, kind, k, highlight, "")

    def stop(self, request: gr.Request | None = None) -> None:
        self.bench.cancel(session_of(request))

    def clear(self, request: gr.Request | None = None) -> tuple:
        """Empty the conversation; a running reply stops after its step and ends cleared."""
        session = session_of(request)
        if request is not None and self.bench.cancel(session):
            self._clearing.add(session)
        return [], [], stats_html(None, "ready"), position_frame(None), notice("")

    def rerender(self, turns: list[Turn], highlight: bool) -> list[dict[str, str]]:
        return chatbot_value(turns or [], highlight)

    def drafter_info(self) -> Any:
        """The drafter control's hint after another model was loaded."""
        return gr.update(info=_drafter_info(self.bench))


def notice(text: str) -> str:
    """An error box in the page (empty when all is well)."""
    if not text:
        return ""
    return f'<div class="sd-notice" role="alert">{html.escape(text)}</div>'


def build_chat_tab(bench: Workbench, default_drafter: str = "auto") -> ChatHandlers:
    """Lay out the Chat tab and wire its events; call inside a gr.Blocks context."""
    handlers = ChatHandlers(bench)
    turns = gr.State([])
    with gr.Row():
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(elem_id="chatbot", height=460, latex_delimiters=[],
                                 label="Conversation",
                                 buttons=["copy"], placeholder="Ask something; accepted draft "
                                 "tokens light up as the reply streams.")
            gr.HTML(legend_html(), elem_id="chat-legend")
            chat_notice = gr.HTML("", elem_id="chat-notice")
            message = gr.Textbox(placeholder="Message (Enter to send, Shift+Enter for a new "
                                 "line)", show_label=False, elem_id="chat-input", autofocus=True,
                                 lines=1, max_lines=8)
            with gr.Row():
                send = gr.Button("Send", variant="primary", elem_id="chat-send")
                stop = gr.Button("Stop", variant="stop", elem_id="chat-stop")
                clear = gr.Button("Clear", elem_id="chat-clear")
        with gr.Column(scale=2):
            stats = gr.HTML(stats_html(None, "ready"), elem_id="chat-stats")
            plot = gr.BarPlot(position_frame(None), x="position", y="acceptance",
                              y_lim=[0, 1], title="acceptance per draft position",
                              height=200, elem_id="chat-positions", sort=POSITIONS)
            highlight = gr.Checkbox(True, label="Highlight accepted draft tokens",
                                    info="off: the reply is rendered as markdown",
                                    elem_id="chat-highlight")
            drafter = gr.Dropdown(list(DRAFTER_CHOICES), value=default_drafter,
                                  label="Drafter", elem_id="chat-drafter",
                                  info=_drafter_info(bench))
            with gr.Row():
                k = k_control(bench.default_k, "chat-k")
                max_new = gr.Slider(16, CHAT_MAX_NEW.high, value=256, step=16,
                                    label=CHAT_MAX_NEW.label, elem_id="chat-max-new")
            with gr.Accordion("Sampling", open=False):
                system = gr.Textbox(DEFAULT_SYSTEM, label="System prompt", lines=2)
                temperature = gr.Slider(TEMPERATURE.low, TEMPERATURE.high, value=0, step=0.05,
                                        label="temperature (0 = greedy)")
                top_p = gr.Slider(TOP_P.low, TOP_P.high, value=1, step=0.05, label="top-p")
                top_k = gr.Slider(TOP_K.low, TOP_K.high, value=0, step=1,
                                  label="top-k (0 = off)")
                min_p = gr.Slider(MIN_P.low, MIN_P.high, value=0, step=0.01, label="min-p")
                seed = gr.Number(-1, label="seed (-1 = random)", precision=0)
    inputs = [message, turns, system, temperature, top_p, top_k, min_p, max_new, seed, drafter,
              k, highlight]
    outputs = [chatbot, turns, stats, plot, chat_notice, message]
    for trigger in (message.submit, send.click):
        trigger(handlers.submit, inputs, outputs, concurrency_id="model", concurrency_limit=1,
                show_progress="hidden")
    stop.click(handlers.stop, None, None, queue=False)
    clear.click(handlers.clear, None, [chatbot, turns, stats, plot, chat_notice], queue=False)
    highlight.change(handlers.rerender, [turns, highlight], chatbot, queue=False)
    handlers.drafter_control = drafter
    return handlers


def _drafter_info(bench: Workbench) -> str:
    if not bench.loaded:
        return "auto picks the best drafter the loaded pair has"
    return bench.resolve("auto").reason
