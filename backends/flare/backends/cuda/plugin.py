"""Registers the CUDA backend.

Importing this module must never fail on a machine without cuda-bindings or
an NVIDIA driver: nothing here imports them; `CudaBackend.probe()` does, and
turns what it finds into a reason (see probe.py). The host emulator used by
the tests (`cuda-emu`) is a separate testing plugin,
flare.backends.cuda_emu, with its own entry point.
"""
from __future__ import annotations

from flare.core import __version__
from flare.core.plugin_manager import hookimpl
from flare.core.specs import BackendSpec

from .backend import CudaBackend


@hookimpl
def flare_backends() -> list[BackendSpec]:
    return [BackendSpec(name="cuda", backend=CudaBackend, version=__version__, priority=100,
                        description="NVIDIA GPUs: NVRTC-compiled kernels replayed as CUDA graphs")]
