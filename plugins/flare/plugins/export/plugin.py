"""The export + serving application plugin (entry point group `flare.plugins`).

It adds `flare export`, claims `flare run NAME.core` for exported core
directories, and declares `flare_export_adapters`, through which model plugins
make themselves exportable.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from flare.core.plugin_manager import hookimpl
from flare.core.specs import CommandSpec

from . import hookspecs


@hookimpl
def flare_addhooks(pluginmanager: Any) -> None:
    pluginmanager.add_hookspecs(hookspecs)


@hookimpl
def flare_cli_commands() -> list[CommandSpec]:
    from . import cli

    return [CommandSpec("export", cli.HELP, cli.add_arguments, cli.cmd_export, cli.DESCRIPTION)]


@hookimpl
def flare_run_target(target: str) -> Callable[[list[str]], int] | None:
    """A directory with a manifest.json is an exported core."""
    path = Path(target)
    if not (path.is_dir() and (path / "manifest.json").exists()):
        return None
    from .cli import run_core

    return lambda argv: run_core(target, argv)
