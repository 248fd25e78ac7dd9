"""The `flare` command line: a thin dispatcher.

    flare backends            what is installed, what is usable here, and why not
    flare models              registered model plugins
    flare run MODEL [ARGS]    a model's main job (ARGS are the model's own; MODEL --help)
    flare describe MODEL      how a model's graph is split over devices, copies, arena bytes
                              (--backends cpu:0,cpu:1, --option KEY=VALUE for the model)

Every other subcommand (`bench`, `export`, `serve`, ...) comes from a plugin's
`flare_cli_commands` hook, and `flare run TARGET` for a target that is not a
model (an exported core) from `flare_run_target`.

Exit codes, the same for every command (plugins' and models' included):
0 ok; 2 bad usage or bad input — an option, a file, an input, a core, an
environment variable, a backend that cannot run here — printed as one line
naming what and where; 1 a failure of the run itself (out of memory, a device
error, a broken installation). `report_error` prints that line and picks the
code (`flare.core.errors.exit_code`); an exception that is not a `FlareError` is a
bug, also printed as one line (exit 1) unless FLARE_TRACEBACK=1 asks for the
traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence, TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .errors import USAGE, FlareError, InputError, exit_code
from .options import add_backends_option, add_model_option, model_options, npy_inputs
from .plugin_manager import get_plugin_manager

def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments `flare run` (for a model without a job) and `flare describe` share."""
    add_backends_option(p)
    add_model_option(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_threads_argument(p)


def _thread_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads, got {text!r}") from None
    if not 1 <= n <= 4096:
        raise argparse.ArgumentTypeError(f"must be between 1 and 4096, got {n}")
    return n


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """`--threads N` (the model CLIs add it too): the CPU device's threads for this run."""
    p.add_argument("--threads", type=_thread_count, default=None, metavar="N",
                   help="CPU threads of the native kernels (default: FLARE_CPU_THREADS, else one per physical core)")


def device_config(threads: int | None) -> dict | None:
    """Session config for `--threads` (None: the backends' defaults)."""
    return {"cpu": {"threads": threads}} if threads is not None else None


_model_options = model_options


def _devices(text: str) -> list[str]:
    from .session import device_list

    return device_list(text, "--backends")


def cmd_backends(args: argparse.Namespace) -> int:
    pm = get_plugin_manager()
    rows = []
    for name, spec in pm.backends().items():
        try:
            probe = spec.backend.probe()
            usable, reason = probe.usable, probe.reason
        except Exception as exc:
            usable, reason = False, f"probe raised {type(exc).__name__}: {exc}"
        devices = []
        if usable:
            try:
                for dev in spec.backend.open_devices({}):
                    devices.append(dev.describe())
                    dev.close()
            except Exception as exc:
                usable, reason = False, f"opening devices failed: {type(exc).__name__}: {exc}"
        rows.append({"name": name, "version": spec.version, "priority": spec.priority, "usable": usable,
                     "status": reason, "devices": devices, "description": spec.description})
    broken = [{"plugin": b.name, "error": b.error} for b in pm.broken]
    if args.json:
        print(json.dumps({"backends": rows, "broken_plugins": broken}, indent=2))
        return 0
    table = Table(title="Flare backends")
    for col in ("backend", "version", "status", "devices (free / total)"):
        table.add_column(col)
    for r in rows:
        devs = "\n".join(f"{d['name']}: {_fmt_bytes(d['free'])} / {_fmt_bytes(d['total'])}" for d in r["devices"]) or "-"
        # the status is text, not markup: install hints say `pip install 'flare-runtime[cuda]'`
        status = ("[green]usable[/] " if r["usable"] else "[red]unusable[/] ") + escape(r["status"])
        table.add_row(r["name"], r["version"], status, devs)
    console = Console()
    console.print(table)
    for b in broken:
        console.print(f"[yellow]broken plugin[/] {escape(b['plugin'])}: {escape(b['error'])}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    pm = get_plugin_manager()
    rows = [{"name": m.name, "version": m.version, "description": m.description, "run": m.run is not None,
             "placement": m.placement is not None, "stage_experts": m.stage_experts is not None}
            for m in pm.models().values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="Flare models")
    for col in ("model", "version", "callbacks", "description"):
        table.add_column(col)
    for r in rows:
        callbacks = [name for name in ("run", "placement", "stage_experts") if r[name]]
        table.add_row(r["name"], r["version"], ", ".join(callbacks) or "-", escape(r["description"]))
    console = Console()
    console.print(table)
    for b in pm.broken:
        console.print(f"[yellow]broken plugin[/] {escape(b.name)}: {escape(b.error)}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    pm = get_plugin_manager()
    runner = pm.hook.flare_run_target(target=args.model)
    if runner is not None:
        return int(runner(list(args.args)) or 0)
    if args.model not in pm.models() and (os.sep in args.model or args.model.endswith(".core")):
        raise InputError(f"{args.model}: no such core directory (nor a model of that name; see `flare models`)")
    spec = pm.model(args.model)
    if spec.run is not None:
        return int(spec.run(list(args.args)) or 0)
    return _run_graph(spec.name, list(args.args))


def _run_graph(model: str, argv: list[str]) -> int:
    """`flare run MODEL` for a model without a job of its own: prepare its graph (its
    placement honoured) and execute every entry on zeros or given .npy inputs."""
    import numpy as np

    from .session import Session

    p = argparse.ArgumentParser(prog=f"flare run {model}",
                                description=f"Prepare {model}'s graph on the given devices and execute its entries.")
    _add_model_arguments(p)
    p.add_argument("--entry", action="append", default=None, help="entry to run (default: every entry)")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="an input array (default: zeros of the model's declared shape)")
    args = p.parse_args(argv)
    options = _model_options(args.option)
    given = npy_inputs(args.input)
    from .dtypes import to_numpy

    report: dict = {"model": model, "entries": {}}
    with Session(_devices(args.backends), config=device_config(args.threads)) as sess:
        pg = sess.prepare_model(model, options)
        for entry in args.entry or sorted(pg.entries):
            if entry not in pg.entries:
                raise InputError(f"--entry {entry}: {model} has no such entry (entries: {', '.join(sorted(pg.entries))})")
            plan = pg.current_plan(entry)
            unknown = sorted(set(given) - set(plan.graph.inputs))
            if unknown:
                raise InputError(f"--input {unknown[0]}: {model}.{entry} has no such input "
                                 f"(inputs: {', '.join(plan.graph.inputs)})")
            inputs = {n: given.get(n, np.zeros(t.shape, to_numpy(t.dtype))) for n, t in plan.graph.inputs.items()}
            outputs = pg.execute(entry, **inputs)
            plan = pg.current_plan(entry)
            report["entries"][entry] = {
                "splits": [{"device": s.device, "nodes": len(s.nodes), "host": s.host} for s in plan.schedule.splits],
                "outputs": {n: {"shape": list(a.shape), "mean": float(np.mean(a)) if a.size else 0.0}
                            for n, a in outputs.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    console = Console()
    for entry, info in report["entries"].items():
        splits = ", ".join(f"{s['device']} ({s['nodes']} nodes{', host' if s['host'] else ''})" for s in info["splits"])
        console.print(f"{model}.{entry}: splits {splits}", highlight=False)
        for name, o in info["outputs"].items():
            console.print(f"  {name}: shape {tuple(o['shape'])}, mean {o['mean']:.6g}", highlight=False)
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    from .session import Session

    describer = get_plugin_manager().hook.flare_describe_target(target=args.model)
    if describer is not None:                   # a file a plugin describes (an ONNX model)
        return int(describer(args) or 0)
    get_plugin_manager().model(args.model)      # unknown model: a clear error before opening devices
    options = _model_options(args.option)
    with Session(_devices(args.backends), config=device_config(args.threads)) as sess:
        pg = sess.prepare_model(args.model, options)
        info = pg.describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    console = Console()
    for entry, e in info["entries"].items():
        table = Table(title=f"{info['name']}.{entry}: {e['nodes']} nodes, {e['splits']} splits, "
                            f"{e['copies']} copies ({_fmt_bytes(e['bytes_copied_per_execute'])} per execute)")
        for col in ("split", "device", "nodes", "copies in"):
            table.add_column(col)
        for i, s in enumerate(e["split_list"]):
            nodes = f"{s['nodes']}: {', '.join(s['node_names'])}"
            table.add_row(str(i), s["device"] + (" (host)" if s["host"] else ""), escape(nodes),
                          escape("\n".join(s["copies"])) or "-")
        console.print(table)
        for fallback in e["placement_fallbacks"]:
            console.print(f"  placement fallback: {fallback}", highlight=False, markup=False)
        for dev, a in e["arena"].items():
            if a["planned"]:
                console.print(f"  arena {dev}: planned {_fmt_bytes(a['planned'])}, liveness lower bound "
                              f"{_fmt_bytes(a['lower_bound'])}, one buffer per tensor {_fmt_bytes(a['naive'])}")
        console.print(f"  prepared in {e.get('prepare_s', 0.0):.2f} s")
        for i, s in enumerate(e["split_list"]):
            if "pipelines" in s:  # a backend that builds pipelines says what this compile cost
                console.print(f"  split {i} ({s['device']}): {s['pipelines']} pipelines, {s.get('pipelines_built', 0)} "
                              f"built, {s.get('pipelines_primed', 0)} primed, {s.get('pipeline_seconds', 0.0):.2f} s")
    for dev, n in info["persistent_bytes"].items():
        console.print(f"persistent (weights, state, inputs) on {dev}: {_fmt_bytes(n)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flare", description="Run model compute graphs on CPU, Vulkan and CUDA.")
    parser.add_argument("--version", action="version", version=f"flare {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("backends", help="installed backends, whether each can run here, and why not")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_backends)
    p = sub.add_parser("models", help="registered model plugins")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("run", help="run a model's main job, or an exported core (flare run MODEL --help)",
                       description="Run a registered model (its own arguments follow) or an exported core directory.")
    p.add_argument("model", help="model name (see `flare models`) or path to an exported .core directory")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the model's own arguments")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("describe", help="how a model's graph is split over devices, copies and arena bytes")
    p.add_argument("model", help="model name (see `flare models`) or a file a plugin claims (MODEL.onnx)")
    _add_model_arguments(p)
    p.set_defaults(func=cmd_describe)
    for spec in get_plugin_manager().commands().values():
        p = sub.add_parser(spec.name, help=spec.help, description=spec.description or spec.help)
        spec.add_arguments(p)
        p.set_defaults(func=spec.run)
    return parser


def report_error(exc: BaseException, stream: TextIO | None = None) -> int:
    """Print `exc` as the one `error:` line every command uses and return its exit code.

    Plain text: one line that scripts can grep, never wrapped at the terminal width,
    written with one call so lines from several MPI ranks never interleave."""
    text = " ".join(str(exc).split()) or "(no message)"
    if isinstance(exc, FlareError) or exit_code(exc) == USAGE:
        line = f"error: {type(exc).__name__}: {text}\n"
    else:
        line = f"error: internal error, {type(exc).__name__}: {text} (FLARE_TRACEBACK=1 shows where)\n"
    out = stream or sys.stderr
    out.write(line)
    out.flush()
    return exit_code(exc)


def _traceback_wanted() -> bool:
    return os.environ.get("FLARE_TRACEBACK", "").strip() not in ("", "0")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except FlareError as exc:       # a plugin that cannot load (e.g. a misspelled hookimpl)
        return report_error(exc)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if _traceback_wanted() and not isinstance(exc, FlareError):
            raise
        return report_error(exc)


if __name__ == "__main__":
    sys.exit(main())
