"""Flare's backend conformance suite on `cuda-emu`: the real CudaDevice over the
host stand-in driver, with the CUDA kernels compiled for the host.

Runs in a subprocess because `cuda-emu` is registered only when
FLARE_CUDA_EMULATE=1 is set when the plugin manager loads. On a GPU the suite
runs on `cuda` itself (scripts/gpu-check.sh)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from flare.backends.cuda_emu.devices import open_device
from flare.plugins.testing.conformance.cases_extra import refused_beyond_the_importer_ops


def test_conformance_suite_passes_on_the_emulated_cuda_device(tmp_path):
    if importlib.util.find_spec("flare.plugins.testing.conformance") is None:
        pytest.skip("flare.plugins.testing.conformance is not installed")
    dev, why = open_device("emulated")
    if dev is None:
        pytest.skip(why)
    dev.close()
    env = {**os.environ, "FLARE_CUDA_EMULATE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "flare.plugins.testing.conformance",
         "--backends=cuda-emu", "--require-backends=cuda-emu"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    assert proc.returncode == 0, tail
    assert " passed" in tail and not refused_beyond_the_importer_ops(proc.stdout), tail
