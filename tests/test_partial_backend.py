"""A partial third-party backend passes the shipped conformance suite.

`tests/partial_backend/flare_f64.py` is the backend an author writes in minutes from
docs/write-a-backend.md: six ops (matmul, add, mul, gelu, softmax, layer_norm) in
float64, every other op refused by `supports`. Built as a wheel and installed next
to this Flare, `pytest --pyargs flare.plugins.testing.conformance --backends=f64`
must pass: cases with a refused node skip (op and fused-chain tests alike), the
lifecycle tests run the refused nodes on the CPU fallback, and the run ends with a
coverage summary. The same backend with an alias-unsafe layer_norm must fail the
kernel-contract test with a message that says so.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent / "partial_backend"
SUPPORTED = ["add", "gelu", "layer_norm", "matmul", "mul", "softmax"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a Python that imports this Flare and the installed f64 backend."""
    root = tmp_path_factory.mktemp("f64")
    dist, site, src = root / "dist", root / "site", root / "src"
    # build from a copy: an in-tree build writes build/ and *.egg-info beside the sources
    shutil.copytree(SOURCE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, cwd=root)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    *map(str, dist.glob("*.whl"))], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("FLARE_DISABLE_PLUGIN_AUTOLOAD", "FLARE_F64_ALIAS_UNSAFE")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["FLARE_CWD"] = str(root)
    return env


def _suite(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfs", "--pyargs",
                           "flare.plugins.testing.conformance", "--backends=f64", "--require-backends", *args],
                          capture_output=True, text=True, env=env, cwd=env["FLARE_CWD"], timeout=600)


def test_partial_backend_passes_the_conformance_suite(installed):
    done = _suite(installed)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and " skipped" in summary and "failed" not in summary, summary
    # refused ops skip with the nodes named, fused chains included
    assert "f64 does not support tanh_0 (tanh)" in out and "f64 does not support sigmoid_" in out
    coverage = out[out.index("flare conformance coverage"):]
    first = coverage.splitlines()[1]
    assert first.startswith(f"f64: {len(SUPPORTED)} of ") and " 0 failed" in first, coverage
    assert f"supported: {', '.join(SUPPORTED)}" in coverage, coverage
    assert "fused ops refused, their chains ran unfused: attention, conv_add, leaky_relu, linear, norm_affine" in coverage, coverage
    fallback = next(line for line in coverage.splitlines() if "lifecycle graphs ran on the cpu fallback" in line)
    assert all(op in fallback for op in ("copy_into", "sum", "tanh")), fallback
    assert "matmul" not in fallback, fallback


def test_alias_unsafe_kernel_is_named(installed):
    env = {**installed, "FLARE_F64_ALIAS_UNSAFE": "1"}
    done = _suite(env, "-k", "alias_safe")
    out = done.stdout
    assert done.returncode == 1, out[-3000:]
    assert "FAILED" in out and "layer_norm_in_place" in out, out[-3000:]
    assert "f64 layer_norm: kernel is not alias-safe: its output aliases its first input" in out, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("1 failed, 4 passed"), out[-3000:]   # only layer_norm is unsafe
