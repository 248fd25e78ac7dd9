"""The layers hold: models -> plugins -> core <- backends, checked by import-linter.

The source tree maps the package `flare` to `core/` and its subpackages to
sibling folders, which import-linter cannot follow through an editable
install; the test assembles the installed layout (as the wheel has it) in a
temporary folder and runs `lint-imports` there with the contracts of
`pyproject.toml`. Lazy imports inside functions count too.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = {"flare": "core", "flare/backends": "backends", "flare/models": "models", "flare/plugins": "plugins"}


def _assemble(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.spv", "*.wav", "*.so")
    for target, source in LAYOUT.items():
        shutil.copytree(ROOT / source, dest / target, ignore=ignore, dirs_exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def test_every_runtime_module_is_under_the_contract():
    """A new module in core/ must be listed, or it could import a backend unchecked."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    listed = set(config["contracts"][0]["source_modules"])
    present = {f"flare.{p.stem}" for p in (ROOT / "core").glob("*.py") if p.stem != "__init__"}
    present |= {f"flare.{p.name}" for p in (ROOT / "core").iterdir() if (p / "__init__.py").exists()}
    assert present == listed, f"runtime modules not under the layer contract: {sorted(present - listed)}"


def test_lint_imports_keeps_every_contract(tmp_path):
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        pytest.fail("import-linter is not installed (it is in the `test` extra)")
    _assemble(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([exe, "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and "KEPT" in proc.stdout
