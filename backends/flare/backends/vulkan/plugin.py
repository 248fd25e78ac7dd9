"""Entry point `flare.backends: vulkan` -> this module.

Importing it must never fail on machines without Vulkan: it only names the
backend class; the binding is imported lazily by `VulkanBackend.probe()`.
"""
from __future__ import annotations

from flare.core.plugin_manager import hookimpl
from flare.core.specs import BackendSpec

from .backend import VulkanBackend

__version__ = "0.1.0"


@hookimpl
def flare_backends() -> list[BackendSpec]:
    """Register the `vulkan` backend (listed before the CPU; sessions choose their own device order)."""
    return [BackendSpec(
        name="vulkan",
        backend=VulkanBackend,
        version=__version__,
        priority=50,
        description="Vulkan compute (GLSL->SPIR-V kernels; GPUs, or Mesa lavapipe on the CPU)",
    )]
