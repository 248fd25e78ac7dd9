"""The serving application plugin (entry point group `flare.plugins`): adds `flare serve NAME.core`."""
from __future__ import annotations

from flare.core.plugin_manager import hookimpl
from flare.core.specs import CommandSpec


@hookimpl
def flare_cli_commands() -> list[CommandSpec]:
    from . import cli

    return [CommandSpec("serve", cli.HELP, cli.add_arguments, cli.run, cli.DESCRIPTION)]


@hookimpl(optionalhook=True)   # declared by the bench plugin, which may be absent
def flare_bench_workloads() -> list:
    from .bench import ServeHttpWorkload

    return [ServeHttpWorkload]
