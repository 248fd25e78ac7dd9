"""The CUDA backend over the REAL cuda-bindings, with a stand-in libcuda.so.1 instead of a GPU.

`HostDriver` (used by the `emulated` tests) replaces the bindings; here the
bindings load a small C driver (flare.backends.cuda_emu.fake_libcuda.c)
through LD_LIBRARY_PATH, resolve its entry points with cuGetProcAddress_v2 and
call them with C arguments, so argument types, out-parameters and result
unpacking of every driver call are checked without a GPU. Kernels run in the
host emulator. Each check runs in a subprocess: libcuda is loaded once per
process. What stays unchecked: the real driver's behaviour and the GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")
from flare.backends.cuda_emu import fake_driver  # noqa: E402
from flare.backends.cuda_emu.emulator import host_compiler  # noqa: E402
from flare.plugins.testing.conformance.cases_extra import refused_beyond_the_importer_ops  # noqa: E402

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def env():
    if fake_driver.c_compiler() is None or host_compiler() is None:
        pytest.skip("no C/C++ compiler to build the stand-in driver and the kernel emulator")
    try:
        from flare.backends.cuda.compiler import nvrtc_version

        nvrtc_version()
    except Exception as exc:
        pytest.skip(f"NVRTC is not usable here: {exc}")
    return {**os.environ, **fake_driver.environment(), "FLARE_REQUIRE_CUDA": "1"}


def _run(args, env, cwd=TESTS):
    proc = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    return proc.returncode, "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])


def test_device_lifecycle_over_the_real_bindings(env):
    """Every `gpu`-kind device test (memory, copies, graph capture, replay, rebind, teardown)."""
    rc, tail = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "test_cuda_device.py"), "-k", "gpu",
                     "--backends=cpu,cuda", "--require-backends=cuda"], env)
    assert rc == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail


def test_conformance_over_the_real_bindings(env, tmp_path):
    rc, tail = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "flare.plugins.testing.conformance",
                     "--backends=cuda", "--require-backends=cuda"], env, cwd=tmp_path)
    assert rc == 0, tail
    assert " passed" in tail and not refused_beyond_the_importer_ops(tail), tail


def test_driver_discipline_and_no_leaks(env):
    """The stand-in refuses calls before cuInit (as the driver does), the probe reads it through
    the bindings, and a session leaves nothing behind in the driver after close."""
    code = r"""
from cuda.bindings import driver
assert driver.cuDeviceGet(0)[0] == driver.CUresult.CUDA_ERROR_NOT_INITIALIZED
import numpy as np
from flare.backends.cuda.backend import CudaBackend
from flare.core.graph import GraphBuilder
from flare.core.session import Session
from flare.backends.cuda_emu.fake_driver import live
verdict = CudaBackend.probe()
assert verdict.usable and "stand-in" in verdict.reason, verdict.reason
w = np.random.default_rng(0).standard_normal((33, 24)).astype(np.float32)
with Session(["cuda"]) as s:
    def build(b, shapes):
        b.output("y", b.softmax(b.matmul(b.input("x", shapes["x"]), b.weight("w", w), transpose_b=True)))
    pg = s.prepare({"full": build}, {"full": {"x": (40, 24)}}, strict=True)
    x = np.random.default_rng(1).standard_normal((40, 24)).astype(np.float32)
    y = pg.execute("full", x=x)["y"]
    ref = np.exp(x @ w.T); ref /= ref.sum(-1, keepdims=True)
    assert np.abs(y - ref).max() < 1e-5
    pg.release()
left = live()
assert not any(left.values()), left
print("ok")
"""
    rc, tail = _run(["-c", code], env)
    assert rc == 0 and tail.endswith("ok"), tail
