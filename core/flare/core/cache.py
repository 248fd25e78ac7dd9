"""Where Flare keeps derived files (compiled kernels, converted weights).

`FLARE_CACHE_DIR` overrides the default `~/.cache/flare`. Everything in it can
be deleted at any time; it is rebuilt on demand.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """`$FLARE_CACHE_DIR`, else `~/.cache/flare` (not created: see cache_dir)."""
    root = os.environ.get("FLARE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "flare"


def cache_dir(*parts: str) -> Path:
    """The cache folder (created) for a component, e.g. cache_dir("cuda")."""
    folder = cache_root().joinpath(*parts)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same folder and a rename, so a
    concurrent reader sees the old file or the new one, never half of one; the temp file is
    removed on failure. Raises OSError (callers of a cache may treat that as "not saved")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
