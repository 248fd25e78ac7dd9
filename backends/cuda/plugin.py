"""Registers the CUDA backend.

Importing this module must never fail on a machine without cuda-bindings or
an NVIDIA driver: nothing here imports them; `CudaBackend.probe()` does, and
turns what it finds into a reason (see probe.py). The host emulator used by
the tests (`cuda-emu`) is a separate testing plugin,
flare.plugins.testing.cuda_emu, with its own entry point.
"""
from __future__ import annotations

from flare import __version__
from flare.plugin_manager import hookimpl
from flare.specs import BackendSpec

from .device import CudaBackend


@hookimpl
def flare_backends() -> list[BackendSpec]:
    return [BackendSpec(name="cuda", backend=CudaBackend, version=__version__, priority=100,
                        description="NVIDIA GPUs: NVRTC-compiled kernels replayed as CUDA graphs")]
