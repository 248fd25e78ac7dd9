"""Command-line options every `flare` command spells the same way.

- `--backends NAMES`: the devices in priority order (`vulkan,cpu`, `cpu:0,cpu:1`);
  `--backend` is still accepted, with a deprecation note on stderr, because
  model jobs and `flare serve` used that spelling before;
- `--option KEY=VALUE`: a model option handed to its `ModelSpec.graph(options)`.

Model plugins and application plugins import these (models -> core is allowed),
so a new backend goes first the same way for every command:
`flare run minilm-l6 --backends mine,cpu "a sentence"`.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from .errors import InputError

BACKENDS = "--backends"
DEPRECATED_BACKEND = "--backend"


class _DeprecatedSpelling(argparse.Action):
    """Stores like the option it stands for, and says on stderr which spelling to use."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        sys.stderr.write(f"note: {option_string} is deprecated; use {BACKENDS} {values}\n")
        setattr(namespace, self.dest, values)


def add_backends_option(parser: argparse.ArgumentParser, *, dest: str = "backends", default: str | None = "cpu",
                        help: str | None = None) -> None:
    """`--backends` (stored in `dest`) plus the deprecated `--backend` writing the same `dest`."""
    parser.add_argument(BACKENDS, dest=dest, default=default, metavar="NAMES",
                        help=help or "devices in priority order, e.g. vulkan,cpu or cpu:0,cpu:1 (default cpu)")
    parser.add_argument(DEPRECATED_BACKEND, dest=dest, action=_DeprecatedSpelling, help=argparse.SUPPRESS)


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a model option passed to its ModelSpec (VALUE is read as JSON if it parses, "
                             "else as text), e.g. --option experts=resident")


def npy_inputs(items: Sequence[str]) -> dict[str, Any]:
    """`--input NAME=FILE.npy` items as {name: array}; never unpickles (allow_pickle=False), and
    a malformed item or an unreadable file is an InputError naming it."""
    import numpy as np

    given: dict[str, Any] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InputError(f"--input {item!r}: expected NAME=FILE.npy")
        try:
            given[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise InputError(f"--input {name}: cannot read {path!r} as a .npy array: {exc}") from None
    return given


def model_options(items: Sequence[str]) -> dict[str, Any]:
    """['slots=8', 'experts=offload'] -> {'slots': 8, 'experts': 'offload'}; InputError naming a bad item."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = str(item).partition("=")
        if not sep or not key.strip():
            raise InputError(f"--option {item!r}: expected KEY=VALUE, e.g. --option experts=resident")
        try:
            options[key.strip()] = json.loads(text)
        except ValueError:
            options[key.strip()] = text
    return options
