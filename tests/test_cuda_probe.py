"""The CUDA probe: each way CUDA can be unusable gets its own reason.

`judge` is pure, so every case is checked here from made-up facts; the real
probe of this machine is checked against what the machine actually has.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from flare.backends.cuda.probe import GpuFacts, ProbeFacts, gather_facts, judge

H200 = GpuFacts(0, "NVIDIA H200", (9, 0), 141 << 30)
ARCHS = (75, 80, 86, 89, 90, 100, 120)
GOOD = ProbeFacts(bindings_version="13.0.0", nvrtc_version=(13, 0), nvrtc_archs=ARCHS,
                  init_status="CUDA_SUCCESS", driver_version=13000, gpus=(H200,))


def with_(**changes) -> ProbeFacts:
    return dataclasses.replace(GOOD, **changes)


def test_usable_names_the_gpu_driver_and_nvrtc():
    r = judge(GOOD)
    assert r.usable and r.devices == ("cuda:0",)
    assert "NVIDIA H200" in r.reason and "sm_90" in r.reason and "NVRTC 13.0" in r.reason


def test_bindings_missing():
    r = judge(ProbeFacts(bindings_error="ModuleNotFoundError: No module named 'cuda'"))
    assert not r.usable and "cuda-bindings is not installed" in r.reason
    assert "pip install flare-runtime[cuda]" in r.reason


def test_nvrtc_missing():
    r = judge(with_(nvrtc_version=None, nvrtc_archs=(), nvrtc_error="libnvrtc.so.13 not found"))
    assert not r.usable and "NVRTC" in r.reason and "pip install nvidia-cuda-nvrtc" in r.reason


def test_no_driver_library():
    r = judge(with_(driver_error="DynamicLibNotFoundError: cuda", init_status=None, driver_version=None, gpus=()))
    assert not r.usable and "no NVIDIA driver" in r.reason and "libcuda" in r.reason


def test_no_driver_wins_over_missing_nvrtc():
    """Hardware first: installing NVRTC would not help a machine without a driver."""
    r = judge(with_(driver_error="DynamicLibNotFoundError", init_status=None, nvrtc_error="missing",
                    nvrtc_version=None, gpus=()))
    assert "no NVIDIA driver" in r.reason


def test_driver_but_no_device():
    r = judge(with_(init_status="CUDA_ERROR_NO_DEVICE", driver_version=12080, gpus=()))
    assert not r.usable
    assert "CUDA_ERROR_NO_DEVICE" in r.reason and "driver 12.8 is installed" in r.reason


def test_init_succeeds_but_zero_devices_is_no_device():
    r = judge(with_(gpus=()))
    assert not r.usable and "no CUDA device" in r.reason


def test_other_init_failure_is_named():
    r = judge(with_(init_status="CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", gpus=()))
    assert not r.usable and "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH" in r.reason


def test_driver_older_than_nvrtc_major():
    r = judge(with_(driver_version=12040, nvrtc_version=(13, 0)))
    assert not r.usable and "too old" in r.reason
    assert "12.4" in r.reason and "13.0" in r.reason


def test_driver_older_minor_is_usable_with_a_note():
    r = judge(with_(driver_version=13000, nvrtc_version=(13, 2)))
    assert r.usable and "CUBIN only" in r.reason


def test_gpu_older_than_nvrtc_supports():
    old = GpuFacts(0, "Tesla K80", (3, 7), 12 << 30)
    r = judge(with_(gpus=(old,)))
    assert not r.usable and "Tesla K80" in r.reason and "sm_37" in r.reason and "sm_75" in r.reason


def test_only_supported_gpus_are_offered():
    old = GpuFacts(1, "Tesla K80", (3, 7), 12 << 30)
    r = judge(with_(gpus=(H200, old)))
    assert r.usable and r.devices == ("cuda:0",)


def test_device_query_failure():
    r = judge(with_(gpus=(), gpu_error="CudaError: cuDeviceGetName failed"))
    assert not r.usable and "cuDeviceGetName" in r.reason


def test_details_carry_every_fact():
    r = judge(with_(driver_version=12040))
    assert r.details["driver_version"] == 12040 and r.details["nvrtc_version"] == (13, 0)


def test_real_probe_of_this_machine_says_why():
    """On a machine without libcuda (like CI), the reason is the missing driver."""
    facts = gather_facts()
    verdict = judge(facts)
    assert verdict.reason
    if facts.bindings_error:
        assert "cuda-bindings" in verdict.reason
    elif facts.driver_error:
        assert not verdict.usable and "no NVIDIA driver" in verdict.reason
    elif facts.init_status == "CUDA_ERROR_NO_DEVICE":
        assert not verdict.usable and "no CUDA device" in verdict.reason


def test_backend_probe_matches_the_facts():
    from flare.backends.cuda.backend import CudaBackend
    from flare.core.errors import BackendUnavailable

    verdict = CudaBackend.probe()
    if not verdict.usable:
        with pytest.raises(BackendUnavailable, match="cuda: "):
            CudaBackend.open_devices()


def test_plugin_imports_and_probes_without_cuda_bindings():
    """`import flare.backends.cuda.plugin` must work where cuda-bindings is absent."""
    code = (
        "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None\n"
        "from flare.backends.cuda.plugin import flare_backends\n"
        "spec = flare_backends()[0]\n"
        "r = spec.backend.probe()\n"
        "assert spec.name == 'cuda' and spec.priority == 100\n"
        "assert not r.usable and 'pip install flare-runtime[cuda]' in r.reason, r.reason\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_emulated_backend_is_registered_only_on_request(monkeypatch):
    from flare.backends.cuda import plugin as cuda_plugin
    from flare.backends.cuda_emu import plugin

    monkeypatch.delenv("FLARE_CUDA_EMULATE", raising=False)
    assert [s.name for s in plugin.flare_backends()] == []
    monkeypatch.setenv("FLARE_CUDA_EMULATE", "1")
    assert [s.name for s in plugin.flare_backends()] == ["cuda-emu"]
    assert [s.name for s in cuda_plugin.flare_backends()] == ["cuda"]  # the runtime's plugin never lists it


def test_the_cuda_backend_never_imports_the_emulator():
    """The host emulator is a testing plugin: importing and probing the backend leaves it unloaded."""
    code = (
        "import sys\n"
        "import flare.backends.cuda.plugin, flare.backends.cuda.device, flare.backends.cuda.backend, flare.backends.cuda.lowering\n"
        "flare.backends.cuda.backend.CudaBackend.probe()\n"
        "bad = [m for m in sys.modules if m.startswith('flare.plugins.testing')]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
