"""Where Flare keeps derived files (compiled kernels, converted weights).

`FLARE_CACHE_DIR` overrides the default `~/.cache/flare`. Everything in it can
be deleted at any time; it is rebuilt on demand.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache folder (created) for a component, e.g. cache_dir("cuda")."""
    root = Path(os.environ.get("FLARE_CACHE_DIR") or Path.home() / ".cache" / "flare")
    folder = root.joinpath(*parts)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
