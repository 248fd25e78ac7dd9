"""Registers the built-in CPU backend."""
from __future__ import annotations

from flare.core import __version__
from flare.core.plugin_manager import hookimpl
from flare.core.specs import BackendSpec

from .backend import CpuBackend


@hookimpl
def flare_backends() -> list[BackendSpec]:
    return [BackendSpec(name="cpu", backend=CpuBackend, version=__version__, priority=0,
                        description="C command-list executor (NumPy kernels where it does not build) over planned arenas (built in)")]
