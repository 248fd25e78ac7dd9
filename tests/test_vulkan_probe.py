"""The Vulkan backend says *why* it cannot run, and chooses devices as documented.

Missing pieces are made missing for real, not mocked: the loader name points at a
library that does not exist, the binding name at a module that does not exist, the
ICD search path at a file that does not exist (in a subprocess, since the loader reads
it at instance creation), and a child interpreter where the binding cannot be imported.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from flare.core.errors import BackendUnavailable
from flare.backends.vulkan import VulkanBackend, loader

PROBE = VulkanBackend.probe()
needs_vulkan = pytest.mark.skipif(not PROBE.usable, reason=f"Vulkan unusable here: {PROBE.reason}")
needs_binding = pytest.mark.skipif(importlib.util.find_spec("vulkan") is None,
                                   reason="the `vulkan` binding is not installed, so the loader is never reached")


def _child(code: str, **env: str) -> str:
    full_env = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@needs_binding
def test_missing_loader_is_named(monkeypatch):
    monkeypatch.setattr(loader, "LOADER_LIBRARIES", ("libflare-absent-vulkan-loader.so.1",))
    probe = VulkanBackend.probe()
    assert not probe.usable
    assert "loader" in probe.reason and "libflare-absent-vulkan-loader.so.1" in probe.reason
    assert "libvulkan1" in probe.reason  # how to install it
    with pytest.raises(BackendUnavailable, match="loader"):
        VulkanBackend.open_devices()


def test_missing_binding_is_named(monkeypatch):
    monkeypatch.setattr(loader, "BINDING_MODULE", "flare_absent_vulkan_binding")
    probe = VulkanBackend.probe()
    assert not probe.usable
    assert "not installed" in probe.reason and "pip install flare-runtime[vulkan]" in probe.reason


def test_plugin_imports_and_probes_without_the_binding():
    """Importing the plugin never imports the binding; probe explains the absence."""
    out = _child(
        "import sys; sys.modules['vulkan'] = None\n"  # `import vulkan` now fails as if not installed
        "import flare.backends.vulkan.plugin as p\n"
        "spec, = p.flare_backends()\n"
        "r = spec.backend.probe()\n"
        "print(spec.name, spec.priority, r.usable, r.reason)\n")
    assert out.startswith("vulkan 50 False") and "pip install flare-runtime[vulkan]" in out


@needs_vulkan
def test_no_icd_is_named():
    out = _child("from flare.backends.vulkan import VulkanBackend\nr = VulkanBackend.probe()\nprint(r.usable, r.reason)",
                 VK_ICD_FILENAMES="/nonexistent/flare-icd.json", VK_DRIVER_FILES="/nonexistent/flare-icd.json")
    assert out.startswith("False") and "ICD" in out and "mesa-vulkan-drivers" in out


@needs_vulkan
def test_probe_lists_devices_and_plugin_is_registered():
    from flare.core.plugin_manager import get_plugin_manager

    assert PROBE.devices and all(d.startswith("vulkan:") for d in PROBE.devices)
    assert PROBE.devices[0] in PROBE.reason
    spec = get_plugin_manager().backends()["vulkan"]
    assert spec.backend is VulkanBackend and spec.priority == 50


@needs_vulkan
def test_device_selection_by_env_and_config(monkeypatch):
    first = PROBE.details[PROBE.devices[0]]["name"]
    monkeypatch.setenv(loader.ENV_DEVICE, first.split()[0].upper())  # name substring, any case
    (dev,) = VulkanBackend.open_devices()
    try:
        assert dev.name == PROBE.devices[0] and dev.info.name == first
    finally:
        dev.close()
    index = PROBE.devices[0].split(":")[1]
    (dev,) = VulkanBackend.open_devices({"device": index})  # config wins over the env
    dev.close()
    monkeypatch.setenv(loader.ENV_DEVICE, "no-such-gpu-anywhere")
    with pytest.raises(BackendUnavailable, match="FLARE_VULKAN_DEVICE.*no-such-gpu-anywhere.*have:"):
        VulkanBackend.open_devices()


def test_preference_order_discrete_integrated_virtual_cpu():
    def fake(index, type_code, name):
        return loader.PhysicalDeviceInfo(index, None, name, type_code, (1, 3, 0), 0, 16, 1 << 27, 1 << 31,
                                         (65535, 65535, 65535), 128, 32768, 32, 64, [(0xF, 0)], [(1 << 31, 1)])
    devices = [fake(0, 4, "llvmpipe"), fake(1, 3, "virtio"), fake(2, 1, "igpu"), fake(3, 2, "dgpu")]
    no_queue = fake(4, 2, "dgpu-without-compute")
    no_queue.compute_family = None
    assert [d.name for d in loader.select(devices + [no_queue])] == ["dgpu", "igpu", "virtio", "llvmpipe"]
    assert [d.index for d in loader.select(devices, "1")] == [1]
    with pytest.raises(BackendUnavailable, match="no Vulkan device offers a compute queue"):
        loader.select([no_queue])
    with pytest.raises(BackendUnavailable, match="no physical device"):
        loader.select([])
