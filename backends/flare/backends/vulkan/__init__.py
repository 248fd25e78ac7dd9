"""Flare's Vulkan backend: compute shaders on any Vulkan 1.1 device (GPUs, or Mesa lavapipe on a CPU).

Nothing here imports the `vulkan` binding at import time: `flare backends` must be
able to list this plugin and say *why* it is unusable on a machine without the
binding, the loader or a driver. The binding is imported inside `probe()` and
`open_devices()` (see `loader.py`).
"""
from __future__ import annotations

from .backend import VulkanBackend

__all__ = ["VulkanBackend"]
