"""The layers hold: models -> plugins -> core <- backends, checked by import-linter.

The source tree maps the package `flare` to `core/` and its subpackages to
sibling folders, which import-linter cannot follow through an editable
install; `scripts/lint_imports.py` assembles the installed layout (as the
wheel has it) in a temporary folder and runs `lint-imports` there with the
contracts of `pyproject.toml`. Lazy imports inside functions count too.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

def test_every_runtime_module_is_under_the_contract():
    """A new module in core/ must be listed, or it could import a backend unchecked."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    listed = set(config["contracts"][0]["source_modules"])
    present = {f"flare.{p.stem}" for p in (ROOT / "core").glob("*.py") if p.stem != "__init__"}
    present |= {f"flare.{p.name}" for p in (ROOT / "core").iterdir() if (p / "__init__.py").exists()}
    assert present == listed, f"runtime modules not under the layer contract: {sorted(present - listed)}"


def test_lint_imports_keeps_every_contract():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "lint_imports.py")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and "KEPT" in proc.stdout
