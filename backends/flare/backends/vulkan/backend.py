"""`VulkanBackend`: probe (usable here, and if not, why) and open devices.

This module imports nothing from the `vulkan` binding at import time, so the plugin
loads on machines without it and `flare backends` can print the reason.
"""
from __future__ import annotations

from typing import Any, Mapping

from flare.core.backend import Backend, Device, ProbeResult
from flare.core.errors import BackendUnavailable

from . import loader


class VulkanBackend(Backend):
    """Vulkan compute on the best available device (discrete > integrated > virtual > CPU)."""

    name = "vulkan"

    @classmethod
    def probe(cls) -> ProbeResult:
        """Find the binding, loader, driver and a compute queue; never raises."""
        try:
            instance, chosen = loader.discover(None)
        except BackendUnavailable as exc:
            return ProbeResult(False, str(exc))
        except Exception as exc:  # probing must not crash `flare backends`
            return ProbeResult(False, f"unexpected error while probing Vulkan: {type(exc).__name__}: {exc}")
        try:
            details = {d.flare_name: {"name": d.name, "type": d.type_name,
                                      "api": ".".join(map(str, d.api_version)), "subgroup_size": d.subgroup_size}
                       for d in chosen}
            summary = "; ".join(d.summary() for d in chosen)
            return ProbeResult(True, f"{len(chosen)} compute device(s): {summary}",
                               tuple(d.flare_name for d in chosen), details)
        finally:
            instance.destroy()

    @classmethod
    def open_devices(cls, config: Mapping[str, Any] | None = None) -> list[Device]:
        """Open the preferred device (or every matching one with config `all_devices`).

        Raises BackendUnavailable with the probe's reason when Vulkan cannot run here.
        """
        from .device import VulkanDevice

        config = dict(config or {})
        instance, chosen = loader.discover(loader.selector_from(config))
        if not config.get("all_devices"):
            chosen = chosen[:1]
        devices: list[Device] = []
        instance.acquire()  # held while opening, so a failed open does not destroy it under the others
        try:
            for info in chosen:
                devices.append(VulkanDevice(info, instance.acquire(), config))
        except BaseException:
            for dev in devices:
                dev.close()
            raise
        finally:
            instance.release()
        return devices
