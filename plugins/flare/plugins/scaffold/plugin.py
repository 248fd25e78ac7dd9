"""The `flare new` application plugin (entry point group `flare.plugins`)."""
from __future__ import annotations

from flare.core.plugin_manager import hookimpl
from flare.core.specs import CommandSpec


@hookimpl
def flare_cli_commands() -> list[CommandSpec]:
    from . import cli

    return [CommandSpec("new", cli.HELP, cli.add_arguments, cli.cmd_new, cli.DESCRIPTION)]
