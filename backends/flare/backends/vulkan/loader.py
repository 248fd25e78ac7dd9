"""Finding Vulkan: the binding, the loader, an instance, physical devices, and the choice among them.

Everything a user needs to hear when Vulkan cannot run is decided here, in the
order a missing piece would be noticed: the `vulkan` Python binding, the loader
library it dlopens (`libvulkan.so.1`), a driver (ICD) that offers a physical
device, and a queue family that can run compute. Each failure becomes a
`BackendUnavailable` whose message names the missing piece and how to install it.

`LOADER_LIBRARIES` and `BINDING_MODULE` are module attributes on purpose: tests
point them at names that do not exist to see the real message for a missing
loader or binding (nothing is mocked; the library is simply absent).
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Mapping, Sequence

from flare.core.errors import BackendUnavailable

BINDING_MODULE = "vulkan"
if sys.platform.startswith("win"):
    LOADER_LIBRARIES: tuple[str, ...] = ("vulkan-1.dll",)
elif sys.platform == "darwin":
    LOADER_LIBRARIES = ("libvulkan.1.dylib", "libvulkan.dylib")
else:
    LOADER_LIBRARIES = ("libvulkan.so.1",)

ENV_DEVICE = "FLARE_VULKAN_DEVICE"
API_VERSION = (1, 1, 0)  # vkGetPhysicalDeviceProperties2 and friends are core from 1.1

# VkPhysicalDeviceType -> (words, preference rank: lower is preferred)
DEVICE_TYPES = {
    2: ("discrete GPU", 0),
    1: ("integrated GPU", 1),
    3: ("virtual GPU", 2),
    4: ("CPU", 3),
    0: ("other", 4),
}

HINT_BINDING = "pip install flare-runtime[vulkan]  (PyPI package `vulkan`, the cffi binding)"
HINT_LOADER = "Debian/Ubuntu: apt install libvulkan1"
HINT_ICD = "Debian/Ubuntu: apt install mesa-vulkan-drivers (lavapipe runs Vulkan on the CPU), or install your GPU's Vulkan driver"


def find_loader() -> str | None:
    """The first loader library in LOADER_LIBRARIES that dlopen accepts, or None."""
    for name in LOADER_LIBRARIES:
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return name
    return None


def import_binding() -> ModuleType:
    """Import the `vulkan` binding, or raise BackendUnavailable saying which piece is missing.

    The loader is checked by dlopen *before* importing, because the binding itself
    raises a generic OSError at import time, and because an already imported
    binding says nothing about whether the loader is still there.
    """
    try:
        spec = importlib.util.find_spec(BINDING_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise BackendUnavailable(f"the Python binding `{BINDING_MODULE}` is not installed: {HINT_BINDING}")
    if find_loader() is None:
        raise BackendUnavailable(
            f"the Vulkan loader ({' / '.join(LOADER_LIBRARIES)}) is missing or not on the library path: {HINT_LOADER}")
    try:
        return importlib.import_module(BINDING_MODULE)
    except OSError as exc:
        raise BackendUnavailable(f"the Vulkan loader could not be loaded by the binding ({exc}): {HINT_LOADER}") from exc
    except Exception as exc:  # a broken binding install must not take Flare down
        raise BackendUnavailable(f"the `{BINDING_MODULE}` binding failed to import: {type(exc).__name__}: {exc}") from exc


@dataclass
class PhysicalDeviceInfo:
    """What Flare needs to know about one physical device, read once."""

    index: int
    handle: Any
    name: str
    type_code: int
    api_version: tuple[int, int, int]
    compute_family: int | None
    min_storage_offset_alignment: int
    max_storage_buffer_range: int
    max_memory_allocation_size: int
    max_workgroup_count: tuple[int, int, int]
    max_push_constants: int
    max_shared_memory: int
    max_storage_buffers_per_stage: int
    non_coherent_atom_size: int
    memory_types: list[tuple[int, int]]  # (propertyFlags, heapIndex)
    memory_heaps: list[tuple[int, int]]  # (size, flags)
    extensions: frozenset[str] = field(default_factory=frozenset)
    subgroup_size: int = 0
    subgroup_ops: int = 0  # VkSubgroupFeatureFlags usable in compute shaders (0 before Vulkan 1.1)
    max_workgroup_invocations: int = 128  # the spec's guaranteed minimum
    # identity, for the persistent VkPipelineCache (pipeline_cache.py) and driver quirks
    vendor_id: int = 0
    device_id: int = 0
    driver_version: int = 0
    pipeline_cache_uuid: bytes = bytes(16)
    device_uuid: bytes = bytes(16)  # VkPhysicalDeviceIDProperties (Vulkan 1.1), else zeros
    driver_id: int = 0  # VkDriverId (Vulkan 1.2), else 0; 13 = VK_DRIVER_ID_MESA_LLVMPIPE (lavapipe)

    @property
    def flare_name(self) -> str:
        return f"vulkan:{self.index}"

    @property
    def type_name(self) -> str:
        return DEVICE_TYPES.get(self.type_code, ("unknown", 5))[0]

    @property
    def rank(self) -> int:
        return DEVICE_TYPES.get(self.type_code, ("unknown", 5))[1]

    def summary(self) -> str:
        major, minor, patch = self.api_version
        return f"{self.flare_name} {self.name} [{self.type_name}, Vulkan {major}.{minor}.{patch}]"


class Instance:
    """A VkInstance shared by the devices opened from it; destroyed when the last one lets go."""

    def __init__(self, vk: ModuleType):
        self.vk = vk
        self._lock = threading.Lock()
        self._refs = 0
        app = vk.VkApplicationInfo(
            pApplicationName="flare", applicationVersion=1, pEngineName="flare", engineVersion=1,
            apiVersion=vk.VK_MAKE_VERSION(*API_VERSION))
        info = vk.VkInstanceCreateInfo(pApplicationInfo=app)
        try:
            self.handle = vk.vkCreateInstance(info, None)
        except vk.VkErrorIncompatibleDriver as exc:
            raise BackendUnavailable(f"no Vulkan driver (ICD) was found by the loader: {HINT_ICD}") from exc
        except vk.VkError as exc:
            raise BackendUnavailable(f"vkCreateInstance failed ({type(exc).__name__}): {HINT_ICD}") from exc

    def acquire(self) -> "Instance":
        with self._lock:
            self._refs += 1
        return self

    def release(self) -> None:
        """Drop one reference; the last one destroys the VkInstance."""
        with self._lock:
            self._refs -= 1
            last = self._refs <= 0
        if last:
            self.destroy()

    def destroy(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self.vk.vkDestroyInstance(handle, None)

    def physical_devices(self) -> list[PhysicalDeviceInfo]:
        """Every physical device the loader reports, in enumeration order (its index is its name)."""
        vk = self.vk
        try:
            handles = list(vk.vkEnumeratePhysicalDevices(self.handle))
        except vk.VkError as exc:
            raise BackendUnavailable(f"vkEnumeratePhysicalDevices failed ({type(exc).__name__}): {HINT_ICD}") from exc
        return [_describe(vk, i, h) for i, h in enumerate(handles)]


def _describe(vk: ModuleType, index: int, handle: Any) -> PhysicalDeviceInfo:
    props = vk.vkGetPhysicalDeviceProperties(handle)
    limits = props.limits
    compute_family = None
    for i, fam in enumerate(vk.vkGetPhysicalDeviceQueueFamilyProperties(handle)):
        if fam.queueFlags & vk.VK_QUEUE_COMPUTE_BIT and fam.queueCount > 0:
            # prefer a family without graphics (a dedicated compute queue) when there is one
            if compute_family is None or not fam.queueFlags & vk.VK_QUEUE_GRAPHICS_BIT:
                compute_family = i
                if not fam.queueFlags & vk.VK_QUEUE_GRAPHICS_BIT:
                    break
    mem = vk.vkGetPhysicalDeviceMemoryProperties(handle)
    types = [(int(mem.memoryTypes[i].propertyFlags), int(mem.memoryTypes[i].heapIndex)) for i in range(mem.memoryTypeCount)]
    heaps = [(int(mem.memoryHeaps[i].size), int(mem.memoryHeaps[i].flags)) for i in range(mem.memoryHeapCount)]
    extensions = frozenset(e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(handle, None))
    max_alloc = 1 << 31
    subgroup = 0
    subgroup_ops = 0
    device_uuid = bytes(16)
    driver_id = 0
    api = int(props.apiVersion)
    api_version = (vk.VK_VERSION_MAJOR(api), vk.VK_VERSION_MINOR(api), vk.VK_VERSION_PATCH(api))
    if api_version >= (1, 1, 0):
        maint3 = vk.VkPhysicalDeviceMaintenance3Properties()
        sub = vk.VkPhysicalDeviceSubgroupProperties(pNext=maint3)
        props2 = vk.VkPhysicalDeviceProperties2(pNext=sub)  # keep the chain alive until the call returns
        vk.vkGetPhysicalDeviceProperties2(handle, props2)
        max_alloc = int(maint3.maxMemoryAllocationSize)
        subgroup = int(sub.subgroupSize)
        if int(sub.supportedStages) & vk.VK_SHADER_STAGE_COMPUTE_BIT:
            subgroup_ops = int(sub.supportedOperations)
        ids = vk.VkPhysicalDeviceIDProperties()
        chain = ids
        if api_version >= (1, 2, 0):
            driver = vk.VkPhysicalDeviceDriverProperties(pNext=ids)
            chain = driver
        props2 = vk.VkPhysicalDeviceProperties2(pNext=chain)
        vk.vkGetPhysicalDeviceProperties2(handle, props2)
        device_uuid = bytes(ids.deviceUUID)
        if api_version >= (1, 2, 0):
            driver_id = int(driver.driverID)
    return PhysicalDeviceInfo(
        index=index, handle=handle, name=str(props.deviceName), type_code=int(props.deviceType),
        api_version=api_version, compute_family=compute_family,
        min_storage_offset_alignment=int(limits.minStorageBufferOffsetAlignment),
        max_storage_buffer_range=int(limits.maxStorageBufferRange),
        max_memory_allocation_size=max_alloc,
        max_workgroup_count=tuple(int(x) for x in limits.maxComputeWorkGroupCount),
        max_push_constants=int(limits.maxPushConstantsSize),
        max_shared_memory=int(limits.maxComputeSharedMemorySize),
        max_storage_buffers_per_stage=int(limits.maxPerStageDescriptorStorageBuffers),
        non_coherent_atom_size=int(limits.nonCoherentAtomSize),
        memory_types=types, memory_heaps=heaps, extensions=extensions, subgroup_size=subgroup,
        subgroup_ops=subgroup_ops, max_workgroup_invocations=int(limits.maxComputeWorkGroupInvocations),
        vendor_id=int(props.vendorID), device_id=int(props.deviceID), driver_version=int(props.driverVersion),
        pipeline_cache_uuid=bytes(props.pipelineCacheUUID), device_uuid=device_uuid, driver_id=driver_id,
    )


def select(devices: Sequence[PhysicalDeviceInfo], selector: str | int | None = None) -> list[PhysicalDeviceInfo]:
    """Compute-capable devices in preference order (discrete, integrated, virtual, CPU).

    `selector` (config `device` or env FLARE_VULKAN_DEVICE) narrows the choice to
    the device with that enumeration index, or whose name contains that text
    (case-insensitive); no match is a BackendUnavailable listing what exists.
    """
    usable = [d for d in devices if d.compute_family is not None]
    if not devices:
        raise BackendUnavailable(f"the Vulkan loader found no physical device (no driver/ICD): {HINT_ICD}")
    if not usable:
        names = ", ".join(d.summary() for d in devices)
        raise BackendUnavailable(f"no Vulkan device offers a compute queue (found: {names})")
    ordered = sorted(usable, key=lambda d: (d.rank, d.index))
    if selector is None or str(selector).strip() == "":
        return ordered
    text = str(selector).strip()
    if text.isdigit():
        chosen = [d for d in ordered if d.index == int(text)]
    else:
        chosen = [d for d in ordered if text.lower() in d.name.lower()]
    if not chosen:
        names = ", ".join(d.summary() for d in ordered)
        raise BackendUnavailable(f"{ENV_DEVICE}/device={text!r} matches no Vulkan compute device (have: {names})")
    return chosen


def selector_from(config: Mapping[str, Any] | None) -> str | None:
    """The device selector: config `device` wins over env FLARE_VULKAN_DEVICE."""
    if config and config.get("device") is not None:
        return str(config["device"])
    return os.environ.get(ENV_DEVICE) or None


def discover(selector: str | None = None) -> tuple[Instance, list[PhysicalDeviceInfo]]:
    """Import the binding, create an instance and choose devices; raises BackendUnavailable with the reason.

    The caller owns the returned instance (release it, or hand references to devices).
    """
    vk = import_binding()
    instance = Instance(vk)
    try:
        chosen = select(instance.physical_devices(), selector)
    except BaseException:
        instance.destroy()
        raise
    return instance, chosen
