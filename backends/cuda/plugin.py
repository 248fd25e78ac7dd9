"""Registers the CUDA backend (and, for testing only, its host emulator).

Importing this module must never fail on a machine without cuda-bindings or
an NVIDIA driver: nothing here imports them; `CudaBackend.probe()` does, and
turns what it finds into a reason (see probe.py).
"""
from __future__ import annotations

import os

from flare import __version__
from flare.plugin_manager import hookimpl
from flare.specs import BackendSpec

from .device import CudaBackend
from .emulator import ENV_FLAG, EmulatedBackend


@hookimpl
def flare_backends() -> list[BackendSpec]:
    specs = [BackendSpec(name="cuda", backend=CudaBackend, version=__version__, priority=100,
                         description="NVIDIA GPUs: NVRTC-compiled kernels replayed as CUDA graphs")]
    if os.environ.get(ENV_FLAG):
        specs.append(BackendSpec(name="cuda-emu", backend=EmulatedBackend, version=__version__, priority=-10,
                                 description="testing aid: the CUDA kernels run on the host (slow)"))
    return specs
