#!/usr/bin/env python3
"""Run `lint-imports` (the layer contracts in pyproject.toml) on the source tree.

`lint-imports` run in the repository root cannot see the package: setup.py maps
`flare` to core/ and its subpackages to sibling folders (backends/, models/,
plugins/), which import-linter cannot follow through an editable install
("Module 'flare.plugins' does not exist"). This script assembles the installed
layout, as the wheel has it, in a temporary folder and runs `lint-imports`
there. Exit status and output are lint-imports' own. CI runs it, and so does
tests/test_layers.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = {"flare": "core", "flare/backends": "backends", "flare/models": "models", "flare/plugins": "plugins"}


def assemble(dest: Path) -> None:
    """Copy the sources into `dest` in the installed layout, with pyproject.toml beside them."""
    ignore = shutil.ignore_patterns("__pycache__", "*.spv", "*.wav", "*.so")
    for target, source in LAYOUT.items():
        shutil.copytree(ROOT / source, dest / target, ignore=ignore, dirs_exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def main() -> int:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        sys.stderr.write("error: lint-imports not found (pip install import-linter; it is in the `test` extra)\n")
        return 2
    with tempfile.TemporaryDirectory(prefix="flare-layers-") as tmp:
        assemble(Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        return subprocess.run([exe, "--no-cache"], cwd=tmp, env=env, timeout=300).returncode


if __name__ == "__main__":
    sys.exit(main())
