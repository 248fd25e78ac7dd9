"""Errors of `flare bench`: each names the configuration file and the key at fault.

A benchmark configuration is written by hand, so a mistake must point at the
line to fix: `a.toml: key 'options.mode': must be one of offline, streaming`.
Both errors are `FlareError`s, so the CLI prints them as one line; a bad
configuration exits 2 (bad input), a benchmark that cannot run exits 1.
"""
from __future__ import annotations

from pathlib import Path

from flare.core.errors import FlareError


class BenchError(FlareError):
    """A benchmark cannot run as asked (a peer is missing, outputs cannot be compared)."""


class BenchConfigError(BenchError):
    """A configuration file is missing, unreadable, or has a bad key or value.

    `path` is the file (None for configurations built in code), `key` the dotted
    key at fault (None when the whole file is)."""

    exit_code = 2  # bad input (flare.core.errors.USAGE)

    def __init__(self, message: str, *, path: Path | str | None = None, key: str | None = None):
        self.path = Path(path) if path is not None else None
        self.key = key
        where = f"{self.path}: " if self.path is not None else ""
        what = f"key {key!r}: " if key else ""
        super().__init__(f"{where}{what}{message}")
