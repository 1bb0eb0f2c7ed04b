"""The Models tab: the pair catalogue, download with progress, verify, load, delete; local files.

Knows: the catalogue (app.catalogue.registry), the store's API (list_pairs, pull with a progress
callback and verify, installed_paths, delete) and the planner's drafter choice with its
reasons; how a load swaps the Workbench's models. Must not know: array libraries, file
formats, sources.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import gradio as gr
import pandas as pd

from app import drafters
from app.core.types import SpecdeckError
from app.ui.background import Background
from app.ui.chat import notice
from app.ui.render import human_bytes
from app.ui.train import build_train_controls
from app.ui.workbench import Choice, Workbench

if TYPE_CHECKING:
    from app.catalogue.sizing import Fit

COLUMNS = ("pair", "drafter", "auto picks", "k", "status", "download", "on disk", "memory",
           "drafter weights", "KV / token target + drafter", "backends",
           "context plain / spec", "streams plain / spec")
FIT_CONTEXT = 4096  # the per-stream context the stream counts assume


def _store_backend(bench: Workbench) -> str | None:
    return None if bench.backend_name == "auto" else bench.backend_name


def pair_status(pair_id: str, bench: Workbench) -> Any:
    from app import store

    rows = store.list_pairs(_store_backend(bench), bench.device, context=FIT_CONTEXT)
    found = [r for r in rows if r.pair.id == pair_id]
    if not found:
        from app.catalogue.registry import load_catalogue
        load_catalogue().pair(pair_id)  # raises with the known ids
    return found[0]


def load_pair(bench: Workbench, pair_id: str,
              progress: Callable[[str], None] = lambda _stage: None) -> None:
    """Load an installed catalogue pair into the Workbench (the caller holds `busy`) and
    remember it as the pair used last; progress(stage) hears each stage."""
    from app import store
    from app.store import recent

    status = pair_status(pair_id, bench)
    pair = status.pair
    if status.note:
        raise SpecdeckError(f"pair {pair_id} is {status.note}: pick another pair")
    progress("checking the files")
    target, draft = store.installed_paths(pair_id, _store_backend(bench))
    auto = auto_choice(pair_id, bench)
    head = str(draft) if draft and pair.drafter_kind in drafters.HEADS else None
    bench.load(str(target), None if head or not draft else str(draft), label=pair.name,
               pair_id=pair.id, head=head, auto_kind=auto, progress=progress)
    recent.remember_pair(pair.id)
    if pair.k and bench.default_k != "auto":  # auto, the app's default, picks k per step
        bench.default_k = pair.k


def auto_choice(pair_id: str, bench: Workbench) -> Choice:
    """What auto runs on a pair: the planner's choice, as `specdeck generate` and `serve`
    make it (Pair.auto: memory, what is downloaded, what the backend runs),
    its lookup the suffix cache where the Chat lane keeps history; the reason its first note."""
    from app.loading import SUFFIX_NOTE, history_kind
    from app.pair import LoadSpec, Pair

    chosen = Pair.auto(LoadSpec(pair_id, backend=bench.backend_name, device=bench.device))
    kind, notes = chosen.kind, chosen.reasons
    if history_kind(kind, bench.keeps_history, "auto") != kind:
        return Choice("suffix", f"auto: {SUFFIX_NOTE}")
    return Choice(kind, f"auto: {notes[0].removeprefix('drafter: ')}" if notes else "auto")


def catalogue_frame(bench: Workbench) -> pd.DataFrame:
    """One row per pair: what it is, whether it is here, what it costs, what fits."""
    from app import store

    rows = []
    for r in store.list_pairs(_store_backend(bench), bench.device, context=FIT_CONTEXT):
        p = r.pair
        drafter = p.drafter_kind  # the drafter's model is named in the pair's card
        status = r.note or ("installed" if r.installed else "not downloaded")
        if bench.pair_id == p.id:
            status += ", loaded"
        size = human_bytes(r.download_bytes) + ("" if r.download_exact else " (est.)")
        if p.unverified(r.backend):
            size += " (unverified id)"  # the card names the source and why
        fit = r.fit
        memory = human_bytes(fit.memory_bytes) if fit is not None else "—"
        drafter_weights = human_bytes(fit.drafter_weights_bytes) if fit is not None else "—"
        kv = _kv_cell(fit) if fit is not None else "—"
        if fit is None:
            context = streams = "—"
        elif not fit.target_fits:
            context, streams = "does not fit", "0 / 0"
        else:
            context = f"{fit.max_context_plain} / {fit.max_context_spec}"
            streams = f"{fit.streams_plain} / {fit.streams_spec}"
        auto = r.plan.choice.kind if r.plan else "—"  # the card says why
        rows.append((p.id, drafter, auto, str(p.k), status, size,
                     human_bytes(r.disk_bytes) if r.disk_bytes else "—", memory,
                     drafter_weights, kv, ", ".join(p.backends), context, streams))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _kv_cell(fit: Fit) -> str:
    """KV per token of target and drafter, and a sliding window's bytes per stream beside it
    (what the window costs each stream of FIT_CONTEXT tokens, whatever the context)."""
    cell = f"{human_bytes(fit.target_kv_per_token)} + {human_bytes(fit.drafter_kv_per_token)}"
    window = sum(fit.window_bytes)
    return cell + (f", window {human_bytes(window)} / stream" if window else "")


def pair_details(bench: Workbench, pair_id: str | None) -> str:
    """A pair's card: what it is, its status, and the planner's drafter choice with reasons."""
    if not pair_id:
        return ""
    from app import store
    from app.catalogue import planner

    try:
        status = pair_status(pair_id, bench)
        backend = status.backend
        plan = planner.plan(status.pair.target.id, backend, bench.device, context=FIT_CONTEXT,
                            installed=lambda model: store.model_path(model, backend))
        reasons = plan.reasons()
    except SpecdeckError as error:
        return notice(str(error))
    p = status.pair
    state = status.note or ("installed" if status.installed else "not downloaded")
    rows = [("name", p.name), ("license", p.license), ("target", p.target.id),
            ("drafter", p.drafter_kind + (f" {p.drafter.id}" if p.drafter else "")),
            ("status", state), ("memory fit", status.fit.summary() if status.fit else "—")]
    rows += [(f"{label} ({p.drafter_kind})", value)
             for label, value in (status.fit.rows() if status.fit else [])]
    rows += [("unverified", note) for note in p.unverified(status.backend)]
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                    for k, v in rows)
    plan_items = "".join(f"<li>{html.escape(line)}</li>" for line in reasons)
    return (f'<div class="sd-pair" data-pair="{html.escape(p.id)}" data-state="'
            f'{html.escape(state)}"><table class="sd-loaded">{cells}</table>'
            f"<div><b>auto drafter for this target</b> (planner):<ul>{plan_items}</ul></div>"
            "<div class=\"sd-fit-help\">memory fit: servable context plain/with speculation, "
            f"streams of {FIT_CONTEXT} tokens plain/with speculation</div></div>")


def loaded_html(bench: Workbench) -> str:
    if not bench.loaded:
        return '<div class="sd-loaded" data-loaded="false">Nothing loaded yet.</div>'
    memory = bench.memory()
    rows = [("target", bench.target.name), ("draft", bench.draft.name if bench.draft else "—"),
            ("device / dtype", f"{bench.target.device} / {bench.target.dtype}"),
            ("context", str(bench.target.context_length)),
            ("weights in memory", human_bytes(memory["weights"])),
            ("auto drafter", bench.resolve("auto").reason)]
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                    for k, v in rows)
    return f'<table class="sd-loaded" data-loaded="true">{cells}</table>'


def progress_html(p: Any) -> str:
    """A store Progress as a bar in the page."""
    if p.message:
        return f'<div class="sd-progress-note">{html.escape(p.message)}</div>'
    total = max(p.total, p.done, 1)
    label = f"{human_bytes(p.done)} / {human_bytes(total)} · {p.file}"
    return (f'<div class="sd-progress" data-done="{p.done}" data-total="{total}">'
            f'<progress value="{p.done}" max="{total}"></progress> {html.escape(label)}</div>')


class ModelsHandlers:
    """Event handlers of the Models tab; every load or delete holds the model's `busy`."""

    def __init__(self, bench: Workbench, bar: Callable[[], str]) -> None:
        self.bench = bench
        self.bar = bar

    def view(self) -> tuple:
        """(model bar, loaded panel, catalogue) after a change."""
        return self.bar(), loaded_html(self.bench), _catalogue_or_empty(self.bench)

    def after_start(self) -> tuple:
        """(loaded panel, catalogue) once the start load has ended; unchanged before."""
        start = self.bench.start
        if start is not None and start.loading:
            return gr.skip(), gr.skip()
        return self.view()[1:]

    def load_files(self, target: str, draft: str) -> Iterator[tuple]:
        """Load local files; yields (model bar, loaded panel, catalogue, notice)."""
        target, draft = (target or "").strip(), (draft or "").strip()
        if not target:
            yield (gr.skip(),) * 3 + (notice("give the target's path: an HF folder or .gguf"),)
            return
        yield from self._exclusive(lambda: self.bench.load(target, draft or None),
                                   "loaded {label}")

    def load(self, pair_id: str | None) -> Iterator[tuple]:
        if not pair_id:
            yield (gr.skip(),) * 3 + (notice("pick a pair first"),)
            return
        yield from self._exclusive(lambda: load_pair(self.bench, pair_id), "loaded {label}")

    def delete(self, pair_id: str | None) -> Iterator[tuple]:
        from app import store

        if not pair_id:
            yield (gr.skip(),) * 3 + (notice("pick a pair first"),)
            return

        def remove() -> None:
            if self.bench.pair_id == pair_id:
                self.bench.unload()  # its files are about to go
            freed = store.delete(pair_id, _store_backend(self.bench))
            gr.Info(f"deleted {pair_id}: {human_bytes(freed)} freed")

        yield from self._exclusive(remove, "")

    def _exclusive(self, action: Callable[[], None], done: str) -> Iterator[tuple]:
        try:
            with self.bench.hold():
                action()
        except Exception as error:  # noqa: BLE001 - shown in the page; the app stays up
            text = failure_text(error)
            gr.Warning(text)
            yield self.view() + (notice(text),)
            return
        if done:
            gr.Info(done.format(label=self.bench.label))
        yield self.view() + (notice(""),)

    def download(self, pair_id: str | None) -> Iterator[tuple]:
        """Pull a pair with a progress bar in the page; yields (progress, catalogue, notice)."""
        yield from self._pull(pair_id, verify=False)

    def verify(self, pair_id: str | None) -> Iterator[tuple]:
        """`specdeck pull --verify`: rehash every installed file of the pair, fetch again what
        fails; yields (progress, catalogue, notice) like download."""
        yield from self._pull(pair_id, verify=True)

    def _pull(self, pair_id: str | None, verify: bool) -> Iterator[tuple]:
        from app import store
        from app.store.cli import pull_summary

        if not pair_id:
            yield gr.skip(), gr.skip(), notice("pick a pair first")
            return
        try:
            status = pair_status(pair_id, self.bench)
        except SpecdeckError as error:
            yield gr.skip(), gr.skip(), notice(str(error))
            return
        if status.note:
            yield gr.skip(), gr.skip(), notice(f"{pair_id} is {status.note}, so there is "
                                               "nothing to run here")
            return
        backend = _store_backend(self.bench)
        job = Background(lambda report: store.pull(pair_id, progress=report, backend=backend,
                                                   verify=verify))
        for latest in job:
            yield progress_html(latest), gr.skip(), notice("")
        if job.error is not None:
            yield gr.skip(), _catalogue_or_empty(self.bench), notice(job.error)
            return
        done = job.done
        text = (pull_summary(done, verify=True) if verify else
                f"{pair_id} is ready: {human_bytes(done.bytes_downloaded)} in "
                f"{done.seconds:.0f} s. Press Load.")
        yield (f'<div class="sd-progress" data-finished="true">{html.escape(text)}</div>',
               _catalogue_or_empty(self.bench), notice(""))


def failure_text(error: Exception) -> str:
    """A failed load or delete in words; memory is the usual cause, so it names the fix."""
    if isinstance(error, SpecdeckError):
        return str(error)
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or "out of memory" in text.lower():
        return f"out of memory: pick a smaller pair or close other programs ({text})"
    return text


def _catalogue_or_empty(bench: Workbench) -> pd.DataFrame:
    try:
        return catalogue_frame(bench)
    except SpecdeckError:
        return pd.DataFrame([], columns=list(COLUMNS))


def _pair_ids() -> list[str]:
    try:
        from app.catalogue.registry import load_catalogue
        return list(load_catalogue().pairs)
    except (ImportError, SpecdeckError):
        return []


def build_models_tab(bench: Workbench, bar_component: Any, bar: Callable[[], str],
                     get_default_first: bool = False, start_timer: Any = None) -> list:
    """Lay out the Models tab; call inside a gr.Blocks context. Returns the events that
    change the loaded models, for other tabs to follow. get_default_first (nothing is
    installed): the default pair's download button comes first, and loads it when done.
    start_timer: ticks while the start load runs; the tab shows its pair once it ends."""
    handlers = ModelsHandlers(bench, bar)
    default = _default_pair()
    get_default = None
    if get_default_first and default:
        gr.Markdown("### Start here\nNothing is installed yet. Download the default pair; it "
                    "loads when the download ends, and Chat is ready.")
        get_default = gr.Button(f"Download {default}", variant="primary",
                                elem_id="models-get-default")
    models_notice = gr.HTML("", elem_id="models-notice")
    gr.Markdown("### Loaded now")
    loaded = gr.HTML(loaded_html(bench), elem_id="models-loaded")
    gr.Markdown("### Catalogue (models.yaml)\nEach pair is a target and its drafter. Memory: "
                f"what serving it takes with speculation at {FIT_CONTEXT} tokens (runtime, "
                "weights, KV caches). Memory fit "
                "is for this machine: the context one stream can hold, and how many streams "
                f"of {FIT_CONTEXT} tokens fit, without and with speculation.")
    ids = _pair_ids()
    table = gr.Dataframe(_catalogue_or_empty(bench), interactive=False, elem_id="models-table",
                         wrap=True)
    with gr.Row():
        first = bench.pair_id or (bench.start.pair_id if bench.start is not None else None)
        pair = gr.Dropdown(ids, value=first or default or (ids[0] if ids else None),
                           label="Pair", elem_id="models-pair", scale=3)
        download = gr.Button("Download", elem_id="models-download", scale=1)
        verify = gr.Button("Verify", elem_id="models-verify", scale=1)
        load = gr.Button("Load", variant="primary", elem_id="models-load", scale=1)
        delete = gr.Button("Delete", variant="stop", elem_id="models-delete", scale=1)
    progress = gr.HTML("", elem_id="models-progress")
    details = gr.HTML(pair_details(bench, pair.value), elem_id="models-details")
    with gr.Accordion("Load local files", open=False):
        with gr.Row():
            target = gr.Textbox(label="Target (HF folder or .gguf)", scale=3)
            draft = gr.Textbox(label="Draft model (optional, same tokenizer)", scale=3)
            load_files = gr.Button("Load files", variant="primary", scale=1)
    build_train_controls(pair)
    outputs = [bar_component, loaded, table, models_notice]
    pair.change(lambda p: pair_details(bench, p), pair, details, queue=False)
    download.click(handlers.download, pair, [progress, table, models_notice],
                   concurrency_id="download", concurrency_limit=1).then(
        lambda p: pair_details(bench, p), pair, details)
    verify.click(handlers.verify, pair, [progress, table, models_notice],
                 concurrency_id="download", concurrency_limit=1)
    loads = [load.click(handlers.load, pair, outputs, concurrency_id="model",
                        concurrency_limit=1),
             load_files.click(handlers.load_files, [target, draft], outputs,
                              concurrency_id="model", concurrency_limit=1)]
    removal = delete.click(handlers.delete, pair, outputs, concurrency_id="model",
                           concurrency_limit=1)
    removal.then(lambda p: pair_details(bench, p), pair, details)
    if get_default is not None:
        fetched = get_default.click(partial(handlers.download, default), None,
                                    [progress, table, models_notice], concurrency_id="download",
                                    concurrency_limit=1)
        loads.append(fetched.then(partial(handlers.load, default), None, outputs,
                                  concurrency_id="model", concurrency_limit=1))
    if start_timer is not None:
        start_timer.tick(handlers.after_start, None, [loaded, table], queue=False)
    return [*loads, removal]


def _default_pair() -> str | None:
    try:
        from app.catalogue.registry import load_catalogue
        return load_catalogue().default_pair
    except (ImportError, SpecdeckError):
        return None
