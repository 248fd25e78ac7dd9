"""The serving application plugin (entry point group `flare.plugins`): adds `flare serve NAME.core`."""
from __future__ import annotations

from flare.plugin_manager import hookimpl
from flare.specs import CommandSpec


@hookimpl
def flare_cli_commands() -> list[CommandSpec]:
    from . import cli

    return [CommandSpec("serve", cli.HELP, cli.add_arguments, cli.run, cli.DESCRIPTION)]
