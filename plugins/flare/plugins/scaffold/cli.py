"""`flare new backend NAME` and `flare new model NAME` (registered by `plugin.py`)."""
from __future__ import annotations

import argparse
from pathlib import Path

HELP = "write a new backend or model plugin distribution to start from"
DESCRIPTION = ("Write flare-backend-NAME/ or flare-model-NAME/: the repository's example plugin "
               "(a backend over private memory, or a mixture-of-experts model with placement and "
               "staging) renamed, installable with pip and passing its own tests as written.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .render import KINDS

    p.add_argument("kind", choices=sorted(KINDS), help="what to write")
    p.add_argument("name", help="the backend's name (devices NAME:0, ...) or the model's name")
    p.add_argument("-o", "--output", type=Path, default=Path("."), metavar="DIR",
                   help="folder to write the distribution in (default: the current folder)")


def cmd_new(args: argparse.Namespace) -> int:
    from flare.core.plugin_manager import get_plugin_manager
    from flare.core.errors import InputError

    from .render import write

    pm = get_plugin_manager()
    taken = pm.backends() if args.kind == "backend" else pm.models()
    if args.name in taken:
        raise InputError(f"{args.kind} {args.name!r} is already registered here; a second plugin of that "
                         f"name would be a PluginError when both are installed")
    target = write(args.kind, args.name, args.output)
    test = "pytest --pyargs flare.plugins.testing.conformance --backends=" + args.name if args.kind == "backend" \
        else f"flare describe {args.name}"
    print(f"wrote {target}/ ({args.kind} {args.name!r}). Next:\n"
          f"  pip install {target}\n"
          f"  pytest {target}/tests\n"
          f"  {test}")
    return 0
