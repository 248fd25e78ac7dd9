"""`flare bench A.toml B.toml`: the subcommand's arguments and its run.

`flare.plugins.bench.plugin` registers it through `flare_cli_commands`.
Nothing heavy is imported here (no model, onnxruntime or matplotlib), so
`flare --help` stays quick and a missing optional package only matters to the
command that needs it.

Exit codes: 0 when A's and B's outputs agree (identical or within the
workload's tolerance) and each configuration is deterministic, 1 when not,
2 for a bad configuration or another Flare error (printed on one line).
"""
from __future__ import annotations

import argparse
from typing import Any



HELP = "compare two configurations (A->B->B->A): speed, peak memory, identical outputs"
DESCRIPTION = ("Run configurations A and B (TOML files) in warmed A B B A blocks over the same requests; "
               "report real-time factor or throughput, latency, peak memory, and whether outputs agree.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("configs", nargs="*", metavar="CONFIG.toml", help="configuration A, then configuration B")
    p.add_argument("--blocks", type=int, default=2, help="number of A B B A blocks (default 2)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default: the model's, e.g. 8)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed requests at the start of each run (default: every request once, so every input "
                        "shape is planned before timing)")
    p.add_argument("--json", metavar="OUT.json", default=None, help="write every figure to this JSON file")
    p.add_argument("--plot", metavar="OUT.png", default=None, help="write a PNG of per-request timings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list-options", metavar="MODEL", nargs="?", const="", default=None,
                   help="list the models flare bench knows, or one model's [options] keys and peers")


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from flare.core.errors import InputError

    if args.list_options is not None:
        return _list_options(args.list_options)
    if len(args.configs) != 2:
        raise InputError(f"flare bench takes two configuration files (A and B), got {len(args.configs)}")
    for name, value, least in (("--blocks", args.blocks, 1), ("--requests", args.requests, 1),
                               ("--warmup", args.warmup, 0)):
        if value is not None and value < least:
            raise InputError(f"{name} must be at least {least}, got {value}")

    from .config import check_pair, check_usable, load_config
    from .harness import run_bench
    from .report import print_report, write_json

    a, b = (load_config(path) for path in args.configs)
    workload = check_pair(a, b)
    check_usable(a)
    check_usable(b)
    console = Console()
    err = Console(stderr=True)
    with _progress(err, runs=4 * args.blocks, enabled=not args.no_progress) as progress:
        result = run_bench(a, b, blocks=args.blocks, requests=args.requests, warmup=args.warmup,
                           progress=progress, workload=workload)
    print_report(result, console)
    if args.json:
        console.print(f"JSON: {write_json(result, args.json)}", highlight=False)
    if args.plot:
        from .plot import write_plot

        console.print(f"plot: {write_plot(result, args.plot)}", highlight=False)
    if not result.ok:
        why = [f"outputs of A and B are {result.outputs.summary()}"] if not result.outputs.within_tolerance else []
        why += [f"{k} is not deterministic" for k, s in result.summaries.items() if not s.deterministic]
        err.print(f"[red]not comparable:[/] {'; '.join(why)}", highlight=False, soft_wrap=True)
        return 1
    return 0


class _progress:
    """A rich progress bar over every request of every run (or nothing)."""

    def __init__(self, console: Any, runs: int, enabled: bool):
        self.console, self.runs, self.enabled = console, runs, enabled
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.console, transient=True)
        self.bar.__enter__()
        return self.update

    def update(self, slot: Any, done: int, per_run: int, phase: str) -> None:
        if self.task is None:
            self.task = self.bar.add_task("starting", total=self.runs * per_run)
        if phase == "prime":
            self.bar.update(self.task, description=f"priming {slot.key} (unrecorded)")
            return
        what = {"open": "opening", "warmup": "warming up", "run": "timing", "done": "done"}[phase]
        self.bar.update(self.task, description=f"block {slot.block + 1}, run {slot.index + 1}/{self.runs}: "
                                               f"{slot.key} {what}", completed=slot.index * per_run + done)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _list_options(model: str) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .workload import get_workload, known_models

    console = Console()
    if not model:
        for name in known_models():
            w = get_workload(name)
            console.print(f"{name}: {w.metric.name}; peers {', '.join(p.name for p in w.peers)}; "
                          f"options {'any (handed to the model)' if w.free_options else ', '.join(w.options)}",
                          highlight=False)
        return 0
    w = get_workload(model)
    table = Table(title=escape(f"{model} [options] (metric: {w.metric.name}, outputs agree within {w.tolerance:g})"),
                  title_justify="left")
    for col in ("key", "type", "default", "A and B must agree", "meaning"):
        table.add_column(col)
    for key, opt in w.options.items():
        kind = opt.kind if isinstance(opt.kind, str) else opt.kind.__name__
        choices = f" ({' | '.join(map(str, opt.choices))})" if opt.choices else ""
        default = list(opt.default) if isinstance(opt.default, tuple) else opt.default
        table.add_row(key, kind + choices, repr(default), "yes" if opt.shapes_requests else "", opt.help)
    console.print(table)
    if w.free_options:
        console.print(f"any other key under [options] is handed to {model}'s graph(options) as it is",
                      highlight=False, markup=False)
    for peer in w.peers:
        reason = w.peer_unavailable(peer.name)
        console.print(f"peer {peer.name}: {peer.help}" + (f" [yellow]({reason})[/]" if reason else ""), highlight=False)
    return 0

