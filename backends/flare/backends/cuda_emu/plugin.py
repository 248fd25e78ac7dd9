"""Registers `cuda-emu` (entry point group flare.backends), for testing only.

Listed only when FLARE_CUDA_EMULATE=1 is set, so `flare backends` on a user's
machine never offers a backend that runs GPU kernels on the host at a crawl.
"""
from __future__ import annotations

import os

from flare.core import __version__
from flare.core.plugin_manager import hookimpl
from flare.core.specs import BackendSpec

from .emulator import ENV_FLAG, EmulatedBackend


@hookimpl
def flare_backends() -> list[BackendSpec]:
    if not os.environ.get(ENV_FLAG):
        return []
    return [BackendSpec(name="cuda-emu", backend=EmulatedBackend, version=__version__, priority=-10,
                        description="testing aid: the CUDA kernels run on the host (slow)")]
