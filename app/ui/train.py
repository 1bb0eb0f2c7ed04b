"""Models tab: "train a head for this target", with the progress `specdeck train-head` prints.

Knows: the controls (prompt sources, how many prompts), the worker thread that runs
app.train.run and the progress it reports, shown as a bar in the page. Must not know: array
libraries, the training itself.
"""

from __future__ import annotations

import html
from collections.abc import Iterator
from typing import Any

import gradio as gr

from app.ui.background import Background
from backends.train_progress import TrainProgress

DEFAULT_SOURCES = "spec-bench"


def progress_html(p: TrainProgress) -> str:
    if p.phase in ("note", "saved"):
        return f'<div class="sd-progress-note">{html.escape(p.message)}</div>'
    return (f'<div class="sd-progress" data-phase="{p.phase}" data-done="{p.done}" '
            f'data-total="{p.total}"><progress value="{p.done}" max="{max(p.total, 1)}">'
            f'</progress> {html.escape(p.line())}</div>')


def train_head(pair_id: str | None, sources: str, limit: float | None) -> Iterator[str]:
    """Train an EAGLE-3 head for the pair's target; yields the progress HTML."""
    from app.train import accuracy_line, run

    if not pair_id:
        yield _note("pick a pair first: the head is trained for its target")
        return
    specs = [s.strip() for s in (sources or DEFAULT_SOURCES).split(",") if s.strip()]
    count = int(limit) if limit else None
    job = Background(lambda report: run(pair_id, specs, limit=count, on_progress=report))
    for latest in job:
        yield progress_html(latest)
    if job.error is not None:
        yield _note(job.error)
        return
    done = job.done
    where = f"pair {done['pair']}" if "pair" in done else done["folder"]
    yield (f'<div class="sd-progress" data-finished="true">head trained: {html.escape(where)}; '
           f'{html.escape(accuracy_line(done))}</div>')


def _note(text: str) -> str:
    return f'<div class="sd-progress-note">{html.escape(text)}</div>'


def build_train_controls(pair: Any) -> None:
    """The accordion under the catalogue; call inside the Models tab's layout."""
    with gr.Accordion("Train a head for this target", open=False):
        gr.Markdown("The pair's target answers the prompts itself, then an EAGLE-3 head "
                    "learns to draft its next tokens (`specdeck train-head`). The head is "
                    "listed as the pair `<target>+eagle3-trained`.")
        with gr.Row():
            sources = gr.Textbox(DEFAULT_SOURCES, label="Prompts (bundled sets or files, "
                                 "comma-separated)", scale=3)
            limit = gr.Number(200, label="At most this many prompts", precision=0, scale=1)
            start = gr.Button("Train head", elem_id="models-train", scale=1)
        progress = gr.HTML("", elem_id="models-train-progress")
    start.click(train_head, [pair, sources, limit], progress, concurrency_id="train",
                concurrency_limit=1)
