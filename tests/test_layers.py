"""The layers hold: models -> plugins -> core <- backends, checked by plain `lint-imports`.

`flare` is a namespace package spread over core/, backends/, plugins/ and
models/, so import-linter follows every import from the repository root with
the contracts of pyproject.toml. Lazy imports inside functions count too. The
second test proves the contracts can fail: a copy of the tree with a model that
imports a backend must be refused.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("core", "backends", "plugins", "models")


def _lint_imports(cwd: Path, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    return subprocess.run([exe, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_lint_imports_keeps_every_contract():
    proc = _lint_imports(ROOT, [ROOT / layer for layer in LAYERS])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and "KEPT" in proc.stdout


def test_a_model_importing_a_backend_breaks_the_contracts(tmp_path: Path):
    for layer in LAYERS:
        shutil.copytree(ROOT / layer, tmp_path / layer, ignore=shutil.ignore_patterns(
            "__pycache__", "*.spv", "*.wav", "*.so", "*.c", "*.cu", "*.comp"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    breach = tmp_path / "models" / "flare" / "models" / "minilm" / "breach.py"
    breach.write_text("import flare.backends.cpu.device  # a model reaching past the runtime\n")
    proc = _lint_imports(tmp_path, [tmp_path / layer for layer in LAYERS])
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert "flare.models.minilm.breach -> flare.backends.cpu.device" in proc.stdout
