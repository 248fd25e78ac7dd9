"""The module the `flare.backends` entry point names: it only registers the backend.

Keep it cheap to import: `flare backends` and every `Session` load it. The
backend class itself opens nothing until `open_devices` is called.
"""
from __future__ import annotations

from flare.core.plugin_manager import hookimpl
from flare.core.specs import BackendSpec

from . import __version__
from .device import MirrorBackend


@hookimpl
def flare_backends() -> list[BackendSpec]:
    return [BackendSpec(name="mirror", backend=MirrorBackend, version=__version__, priority=-1,
                        description="example plugin: Flare's CPU kernels interpreted over private memory")]
