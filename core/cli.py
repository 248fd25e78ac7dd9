"""The `flare` command line.

    flare backends            what is installed, what is usable here, and why not
    flare models              registered model plugins
    flare run MODEL [ARGS]    a model's main job (ARGS are the model's own; MODEL --help)
    flare describe MODEL      how a model's graph is split over devices, copies, arena bytes

Subcommands added by later layers (bench, export, core loading) register here too.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from rich.console import Console
from rich.table import Table

from . import __version__
from .errors import FlareError

def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_backends(args: argparse.Namespace) -> int:
    from .plugin_manager import get_plugin_manager

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
        status = ("[green]usable[/] " if r["usable"] else "[red]unusable[/] ") + r["status"]
        table.add_row(r["name"], r["version"], status, devs)
    console = Console()
    console.print(table)
    for b in broken:
        console.print(f"[yellow]broken plugin[/] {b['plugin']}: {b['error']}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from .plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    models = pm.models()
    if args.json:
        print(json.dumps([{"name": m.name, "version": m.version, "description": m.description,
                           "entries": sorted(m.entries)} for m in models.values()], indent=2))
        return 0
    table = Table(title="Flare models")
    for col in ("model", "entries", "description"):
        table.add_column(col)
    for m in models.values():
        table.add_row(m.name, ", ".join(sorted(m.entries)) or "-", m.description)
    Console().print(table)
    for b in pm.broken:
        Console().print(f"[yellow]broken plugin[/] {b.name}: {b.error}")
    return 0


def _model(name: str):
    from .plugin_manager import get_plugin_manager

    models = get_plugin_manager().models()
    if name not in models:
        raise FlareError(f"unknown model {name!r}; registered: {', '.join(sorted(models)) or 'none'} (see `flare models`)")
    return models[name]


def cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    target = args.model
    if Path(target).is_dir() and (Path(target) / "manifest.json").exists() and "core" in RUNNERS:
        return RUNNERS["core"](target, list(args.args))
    spec = _model(target)
    if spec.run is None:
        raise FlareError(f"model {target!r} has no command-line main job")
    return int(spec.run(list(args.args)) or 0)


def cmd_describe(args: argparse.Namespace) -> int:
    from .session import Session

    spec = _model(args.model)
    if spec.prepare is None:
        raise FlareError(f"model {args.model!r} cannot be described (its plugin gives no prepare())")
    with Session(args.backends.split(",")) as sess:
        pg = spec.prepare(sess)
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
            table.add_row(str(i), s["device"] + (" (host)" if s["host"] else ""), str(s["nodes"]), "\n".join(s["copies"]) or "-")
        console.print(table)
        for dev, a in e["arena"].items():
            if a["planned"]:
                console.print(f"  arena {dev}: planned {_fmt_bytes(a['planned'])}, liveness lower bound "
                              f"{_fmt_bytes(a['lower_bound'])}, one buffer per tensor {_fmt_bytes(a['naive'])}")
    for dev, n in info["persistent_bytes"].items():
        console.print(f"persistent (weights, state, inputs) on {dev}: {_fmt_bytes(n)}")
    return 0


# other layers (core loading, bench, export) add runners and subcommands here
RUNNERS: dict[str, Callable[..., int]] = {}
EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


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
    p.add_argument("model", help="model name (see `flare models`)")
    p.add_argument("--backends", default="cpu", help="devices in priority order, e.g. vulkan,cpu (default cpu)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_describe)
    for add in EXTRA_COMMANDS:
        add(sub)
    return parser


def _load_extensions() -> None:
    """Import the layers that add subcommands (bench, export/core), if present."""
    import importlib

    for module in ("flare.plugins.bench.cli", "flare.plugins.export.cli"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module and not module.startswith(exc.name or "\0"):
                raise


def main(argv: Sequence[str] | None = None) -> int:
    _load_extensions()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FlareError as exc:
        # plain text: one line that scripts can grep, never wrapped at the terminal width,
        # written with one call so lines from several MPI ranks never interleave
        sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
