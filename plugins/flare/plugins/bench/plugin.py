"""The `flare bench` application plugin (entry point group `flare.plugins`).

It adds the `bench` subcommand and declares the hooks through which model
plugins contribute workloads and peers (`flare.plugins.bench.hookspecs`).
"""
from __future__ import annotations

from flare.core.plugin_manager import hookimpl
from flare.core.specs import CommandSpec

from . import hookspecs


@hookimpl
def flare_addhooks(pluginmanager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


@hookimpl
def flare_cli_commands() -> list[CommandSpec]:
    from . import cli

    return [CommandSpec("bench", cli.HELP, cli.add_arguments, cli.cmd_bench, cli.DESCRIPTION)]
