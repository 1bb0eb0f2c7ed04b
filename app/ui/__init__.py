"""`specdeck ui`: the Gradio app. Chat, Race, Models and Bench tabs over one Workbench.

Knows: the command's flags, the page layout (one module per tab), how the app is launched
(127.0.0.1 by default, never a public share link, Host headers checked against DNS rebinding
by app/ui/hosts.py, one generation per model through the queue). Must not know: array
libraries; engines come from the Workbench, events from the engine. Tabs: app/ui/chat.py,
race.py, models.py, bench.py; event rendering: render.py; numeric controls: inputs.py.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
import time
from typing import Any

from app.catalogue.shipped import shipped_path
from app.core.types import SpecdeckError

ASSETS = shipped_path("assets")
START_POLL_S = 0.5  # how often an open page refreshes the header while the start load runs


def add_subcommand(subparsers: Any) -> None:
    from app.flags import add_model_arguments

    p = subparsers.add_parser("ui", help="open the app: chat, race, models, bench (Gradio)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--pair", help="catalogue pair id to load at start (default: the pair "
                   "used last, else the only installed pair, else the default pair if installed)")
    add_model_arguments(p)
    from app.remote_flags import add_remote_arguments

    add_remote_arguments(p)  # Chat through a server; Race and Bench need a local model
    p.set_defaults(handler=_ui, drafter="auto", k="auto")


def _ui(args: argparse.Namespace) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from app.core.types import SpecdeckError
    from app.ui.hosts import LOOPBACK, host_guard
    from app.ui.workbench import Workbench

    started = time.perf_counter()
    bench = Workbench(args.backend, args.device, args.dtype, default_k=args.k,
                      draft_dtype=getattr(args, "draft_dtype", None),
                      history=not getattr(args, "no_history", False))
    message = attach_remote(bench, args) if args.remote else load_at_start(bench, args)
    loaded_s = time.perf_counter() - started
    demo = build_app(bench, drafter=args.drafter, start_notice=message,
                     nothing_installed=bench.remote is None and not bench.loaded
                     and bench.start is None
                     and not installed_here(bench))
    demo.queue(default_concurrency_limit=1)
    if args.host.strip("[]") not in LOOPBACK:
        print(f"specdeck: warning: binding {args.host} makes the app reachable from other "
              "machines, and it has no login; requests that address it by a name other than "
              "localhost are refused (DNS rebinding), so use its IP address", file=sys.stderr)
    try:
        demo.launch(server_name=args.host, server_port=args.port, share=False, ssr_mode=False,
                    inbrowser=False, prevent_thread_lock=True, quiet=True, footer_links=[],
                    css=read_css(), mcp_server=False,
                    app_kwargs={"middleware": host_guard(args.host)})
    except OSError as error:
        raise SpecdeckError(f"cannot serve on {args.host}:{args.port} ({error}): pick another "
                            "port with --port") from error
    spent = (f"{bench.start.pair_id} is loading in the background" if bench.start is not None
             else f"{loaded_s:.1f} s of them loading")
    print(f"specdeck: the app is ready at {demo.local_url} ({time.perf_counter() - started:.1f}"
          f" s after start, {spent}); Ctrl+C stops it", flush=True)
    try:
        demo.block_thread()
    finally:
        demo.close()
    return 0


def load_at_start(bench: Any, args: argparse.Namespace) -> str:
    """Load --target/--draft before the page opens; otherwise begin loading --pair or the
    pair the start rule picks (app/ui/start.py) in the background. A problem becomes a
    notice."""
    from app.core.types import SpecdeckError
    from app.ui.start import StartLoad, choose_start

    if args.pair and args.target:
        raise SpecdeckError("give either --pair or --target, not both")
    if args.target and not os.path.exists(args.target) and _is_pair(args.target):
        args.pair, args.target = args.target, None  # --target may name a catalogue pair
    if args.target:
        print(f"specdeck: loading {args.target}" + (f" + {args.draft}" if args.draft else ""),
              flush=True)
        bench.load(args.target, args.draft)
        return ""
    try:
        choice = choose_start(_backend(bench), args.pair)
        if args.pair and args.pair not in choice.installed:  # not downloaded: the fix, at once
            from app import store
            store.installed_paths(args.pair, _backend(bench))
    except SpecdeckError as error:
        print(f"specdeck: {error}", file=sys.stderr, flush=True)
        return str(error)
    if choice.pair_id is None:
        print(f"specdeck: {choice.reason}", flush=True)
        bench.start_reason = choice.reason
        return ""
    print(f"specdeck: loading pair {choice.pair_id} ({choice.reason}) while the app opens",
          flush=True)
    StartLoad(bench, choice).begin()
    return ""


def attach_remote(bench: Any, args: argparse.Namespace) -> str:
    """Connect Chat to --remote before the page opens; a bad URL or key stops the command."""
    from app.remote_flags import connect_remote

    if args.pair:
        raise SpecdeckError("--pair loads a local model: drop it with --remote")
    bench.attach_remote(connect_remote(args))
    print(f"specdeck: chatting through {bench.label} ({bench.remote.target.name})", flush=True)
    return ""


def _backend(bench: Any) -> str:
    from backends import detect_backend

    return detect_backend() if bench.backend_name == "auto" else bench.backend_name


def installed_here(bench: Any) -> bool:
    from app.core.types import SpecdeckError
    from app.ui.start import installed_pairs

    try:
        return bool(installed_pairs(_backend(bench)))
    except SpecdeckError:
        return False


def _is_pair(name: str) -> bool:
    try:
        from app.catalogue.registry import load_catalogue
        return name in load_catalogue().pairs
    except Exception:  # noqa: BLE001 - no catalogue: the name is a path that does not exist
        return False


def read_css() -> str:
    path = ASSETS / "ui.css"
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def model_bar(bench: Any) -> str:
    """The line under the title: what is loaded, on which device, and why that pair (or the
    start load's progress)."""
    if getattr(bench, "remote", None) is not None:
        text = (f"{bench.label}: {bench.remote.target.name} · Chat runs on that server "
                "(its drafter and k); Race and Bench need a local model")
        return f'<div class="sd-model-bar" data-loaded="remote">{html.escape(text)}</div>'
    start = bench.start
    if start is not None and (start.loading or start.error and not bench.loaded):
        return start.status_html()  # a failure shows until a pair is loaded from Models
    if not bench.loaded:
        why = (html.escape(bench.start_reason) if bench.start_reason
               else "open <b>Models</b> to download and load a pair")
        return f'<div class="sd-model-bar" data-loaded="false">No model loaded: {why}.</div>'
    target = bench.target
    draft = f" + draft {bench.draft.name}" if bench.draft is not None else ""
    text = (f"{bench.label}: target {target.name}{draft} · {target.device} "
            f"{target.dtype} · context {target.context_length}")
    if start is not None and bench.pair_id == start.pair_id:
        text += f" · loaded at start: {start.choice.reason}"
    return f'<div class="sd-model-bar" data-loaded="true">{html.escape(text)}</div>'


def build_app(bench: Any, drafter: str = "auto", start_notice: str = "",
              nothing_installed: bool = False) -> Any:
    """The whole page as gr.Blocks; handlers close over `bench`, no module globals.
    With nothing installed it opens on Models, the default pair's download first."""
    import gradio as gr

    from app.ui.bench import build_bench_tab
    from app.ui.chat import build_chat_tab, notice
    from app.ui.models import build_models_tab
    from app.ui.race import build_race_tab

    with gr.Blocks(title="specdeck", analytics_enabled=False) as demo:
        gr.HTML('<div class="sd-title"><b>specdeck</b> · same output, fewer target forwards: '
                'lossless speculative decoding on your machine</div>')
        bar = gr.HTML(model_bar(bench), elem_id="model-bar")
        gr.HTML(notice(start_notice), elem_id="start-notice")
        with gr.Row():
            history_line = gr.HTML(f'<div class="sd-history">{html.escape(bench.history_notice)}'
                                   '</div>', elem_id="history-notice")
            clear = gr.Button("Clear history", size="sm", elem_id="clear-history",
                              interactive=bench.keeps_history)
        clear.click(lambda: f'<div class="sd-history">{html.escape(bench.clear_history())}'
                            '</div>', outputs=history_line)
        # polls the start load's progress into the header; stops once the load has ended
        starting = bench.start is not None and bench.start.loading
        timer = gr.Timer(START_POLL_S, active=starting)
        with gr.Tabs(selected="models" if nothing_installed else "chat"):
            with gr.Tab("Chat", id="chat", elem_id="tab-chat"):
                chat = build_chat_tab(bench, drafter)
            with gr.Tab("Race", id="race", elem_id="tab-race"):
                build_race_tab(bench, chat.stop)
            with gr.Tab("Models", id="models", elem_id="tab-models"):
                changes = build_models_tab(bench, bar, lambda: model_bar(bench),
                                           get_default_first=nothing_installed,
                                           start_timer=timer)
            with gr.Tab("Bench", id="bench", elem_id="tab-bench"):
                bench_tab = build_bench_tab(bench)
        for change in changes:
            change.then(chat.drafter_info, None, chat.drafter_control, queue=False)
            bench_tab.follow(change.then)  # the Bench tab shows the pair now loaded

        def tick() -> tuple:
            still = bench.start is not None and bench.start.loading
            return model_bar(bench), gr.Timer(active=still)

        ticked = timer.tick(tick, None, [bar, timer], queue=False)
        ticked.then(chat.drafter_info, None, chat.drafter_control, queue=False)
        bench_tab.follow(ticked.then)  # the pair the start load brought
        demo.load(lambda: model_bar(bench), None, bar, queue=False)
        bench_tab.follow(demo.load)  # a page opened after a switch: built values are stale
        demo.unload(chat.stop)  # a closed tab stops its generation after the current step
    return demo
