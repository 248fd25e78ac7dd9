"""`VulkanDevice`: one VkDevice with one compute queue, its memory, caches and transfers.

Config keys (from `open_devices(config)`; environment variables in brackets):
- `force_staging` [FLARE_VULKAN_FORCE_STAGING=1]: never map device buffers; move bytes
  through staging buffers and vkCmdCopyBuffer, as on a discrete GPU (`host_view` is None).
- `kernel_profile` [FLARE_VULKAN_KERNEL_PROFILE=cpu|gpu]: which default kernel variants
  (workgroup and tile sizes, see variants.py) to use; by device type when unset.
- `max_buffer_size`: lower the largest single buffer below the device's limit (tests).
- `device` [FLARE_VULKAN_DEVICE], `all_devices`: which devices open (see loader.select).
- `pipeline_cache` [FLARE_VULKAN_PIPELINE_CACHE=0]: keep the VkPipelineCache in Flare's
  cache folder (default on; pipeline_cache.py); `pipeline_cache_max_bytes` bounds the file.
- `prime` [FLARE_VULKAN_PRIME=auto|1|0]: compile new pipelines at prepare on several queues
  for drivers that compile at first dispatch (lavapipe; prime.py).
- `build_threads`: worker threads for pipeline builds and priming (default: usable CPUs).
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from collections import Counter
from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from flare.core.backend import Binding, BufferType, Device, MemoryInfo, PreparedSplit, SplitProgram, numpy_view
from flare.core.dtypes import to_numpy
from flare.core.errors import AllocationError, BackendUnavailable, FlareError, ReleasedError, ShapeError
from flare.core.graph import Tensor
from flare.core.ledger import LEDGER

from . import lowering, variants
from .loader import Instance, PhysicalDeviceInfo
from .memory import Allocation, Memory, MemoryTypes
from .pipeline_cache import DEFAULT_MAX_BYTES, ENV_PIPELINE_CACHE, DiskPipelineCache, cache_folder
from .pipelines import Key, Pipelines, build_workers
from .prime import ENV_PRIME, PrimedRecord, prime, prime_mode, record_path

ENV_FORCE_STAGING = "FLARE_VULKAN_FORCE_STAGING"
ENV_KERNEL_PROFILE = "FLARE_VULKAN_KERNEL_PROFILE"
FEEDBACK_EXT = "VK_EXT_pipeline_creation_feedback"
# objects whose life follows buffers and prepared splits (back to baseline after release)
LIVE_KEYS = ("buffers", "memories", "descriptor_pools", "command_pools", "command_buffers", "fences")
# the device-lifetime cache: grows on first use of a kernel, freed by close()
CACHE_KEYS = ("pipelines", "pipeline_layouts", "descriptor_set_layouts", "shader_modules", "pipeline_caches")


def _truthy(value: Any, where: str = "force_staging") -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    from flare.core.errors import InputError

    raise InputError(f"{where}={value!r}: expected 1/0, true/false, yes/no or on/off")


class VulkanDevice(Device):
    """A Flare device backed by one Vulkan physical device."""

    backend = "vulkan"

    def __init__(self, info: PhysicalDeviceInfo, instance: Instance, config: Mapping[str, Any] | None = None):
        super().__init__(info.flare_name)
        config = dict(config or {})
        self.info = info
        self.instance = instance
        self.vk = vk = instance.vk
        self.live: Counter = Counter({k: 0 for k in LIVE_KEYS + CACHE_KEYS})
        if "force_staging" in config:
            force = _truthy(config["force_staging"])
        else:
            force = _truthy(os.environ.get(ENV_FORCE_STAGING, "0"), ENV_FORCE_STAGING)
        self.force_staging = force
        self.kernel_profile = variants.profile_of(info, config.get("kernel_profile") or os.environ.get(ENV_KERNEL_PROFILE))
        limit = min(info.max_memory_allocation_size, info.max_storage_buffer_range)
        if config.get("max_buffer_size"):
            limit = min(limit, int(config["max_buffer_size"]))
        self._buffer_type = BufferType(f"{self.name}:device", max(info.min_storage_offset_alignment, 16), limit)
        self.queue_family = info.compute_family
        self._queue_lock = threading.Lock()
        self._transfer_lock = threading.Lock()
        # allocation, free, split release and close never interleave (close destroys what they touch)
        self._mem_lock = threading.RLock()
        self._allocs: dict[int, Allocation] = {}
        self._splits: set[PreparedSplit] = set()  # strong: close() must reach splits nobody released
        self.handle = None
        self.disk_cache: DiskPipelineCache | None = None
        workers = int(config.get("build_threads") or build_workers())
        self._prime_lanes = min(workers, prime_mode(info, config.get("prime", os.environ.get(ENV_PRIME))))
        self._primed: set[Key] = set()
        self._prime_lock = threading.Lock()
        self.prime_stats = {"primed": 0, "seconds": 0.0, "lanes": 0}
        if "pipeline_cache" in config:
            use_disk = _truthy(config["pipeline_cache"], "pipeline_cache")
        else:
            use_disk = _truthy(os.environ.get(ENV_PIPELINE_CACHE, "1"), ENV_PIPELINE_CACHE)
        # pipelines primed by an earlier process (its record sits beside the pipeline cache)
        self._primed_record = PrimedRecord(record_path(info, cache_folder())) if self._prime_lanes and use_disk else None
        try:
            prio = vk.ffi.new("float[1]", [1.0])
            qinfo = vk.VkDeviceQueueCreateInfo(queueFamilyIndex=self.queue_family, queueCount=1, pQueuePriorities=prio)
            # creation feedback says whether a pipeline came from the VkPipelineCache (stats only);
            # the instance asks for Vulkan 1.1, so it is the extension, enabled where offered
            feedback = FEEDBACK_EXT in info.extensions
            exts = [FEEDBACK_EXT] if feedback else []
            dinfo = vk.VkDeviceCreateInfo(queueCreateInfoCount=1, pQueueCreateInfos=[qinfo],
                                          enabledExtensionCount=len(exts), ppEnabledExtensionNames=exts or None)
            self.handle = vk.vkCreateDevice(info.handle, dinfo, None)
            self.queue = vk.vkGetDeviceQueue(self.handle, self.queue_family, 0)
            self.types = MemoryTypes(info, force)
            self.memory_pool = Memory(vk, self.handle, self.name, self.types, self.live)
            self.disk_cache = DiskPipelineCache(vk, self.handle, info, enabled=use_disk,
                                                max_bytes=int(config.get("pipeline_cache_max_bytes") or DEFAULT_MAX_BYTES))
            self.live["pipeline_caches"] += 1
            self.pipelines = Pipelines(vk, self.handle, self.live, vk_cache=self.disk_cache.handle,
                                       feedback=feedback, workers=workers)
            # one command buffer and fence for staging copies, created up front so leak
            # checks see a constant baseline
            pool_info = vk.VkCommandPoolCreateInfo(queueFamilyIndex=self.queue_family,
                                                   flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT)
            self._xfer_pool = vk.vkCreateCommandPool(self.handle, pool_info, None)
            self.live["command_pools"] += 1
            alloc = vk.VkCommandBufferAllocateInfo(commandPool=self._xfer_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                                                   commandBufferCount=1)
            self._xfer_cmd = vk.vkAllocateCommandBuffers(self.handle, alloc)[0]
            self.live["command_buffers"] += 1
            self._xfer_fence = vk.vkCreateFence(self.handle, vk.VkFenceCreateInfo(), None)
            self.live["fences"] += 1
        except vk.VkError as exc:
            self._destroy_device_objects()
            instance.release()
            raise BackendUnavailable(f"could not open {info.summary()}: {type(exc).__name__}") from exc

    # -- memory -------------------------------------------------------------------------
    @property
    def mapped(self) -> bool:
        """Whether buffers are host-mapped (False on discrete GPUs and with force_staging)."""
        return self.types.mapped

    def buffer_type(self) -> BufferType:
        return self._buffer_type

    def memory(self) -> MemoryInfo:
        """Heap size minus what Flare holds (or the driver's budget with VK_EXT_memory_budget)."""
        heap = self.types.device_heap
        total = self.info.memory_heaps[heap][0]
        used = LEDGER.live_bytes(self.name)
        free = total - used
        if "VK_EXT_memory_budget" in self.info.extensions:
            try:
                vk = self.vk
                budget = vk.VkPhysicalDeviceMemoryBudgetPropertiesEXT()
                props = vk.VkPhysicalDeviceMemoryProperties2(pNext=budget)
                vk.vkGetPhysicalDeviceMemoryProperties2(self.info.handle, props)
                free = min(free, int(budget.heapBudget[heap]) - int(budget.heapUsage[heap]))
            except Exception:  # a driver quirk in an optional query must not break allocation
                pass
        return MemoryInfo(free=max(int(free), 0), total=int(total))

    def _alloc_raw(self, nbytes: int) -> Allocation:
        limit = self._buffer_type.max_size
        if nbytes > limit:
            raise AllocationError(self.name, nbytes, self.memory().free, f"above the device's largest buffer ({limit} bytes)")
        free = self.memory().free
        with self._mem_lock:
            if self.closed or self.handle is None:
                raise ReleasedError(f"device {self.name} is closed")
            alloc = self.memory_pool.create(nbytes, free_hint=free)
            self._allocs[id(alloc)] = alloc
        return alloc

    def _free_raw(self, handle: Allocation) -> None:
        with self._mem_lock:
            self._allocs.pop(id(handle), None)
            if self.handle is not None:
                self.memory_pool.destroy(handle)

    # -- bytes in and out -----------------------------------------------------------------
    def host_view(self, binding: Binding) -> np.ndarray | None:
        alloc: Allocation = binding.buffer.handle
        if alloc is None or alloc.mapped is None:
            return None
        return numpy_view(alloc.mapped, binding)

    def write(self, binding: Binding, array: np.ndarray) -> None:
        arr = np.asarray(array)
        if tuple(arr.shape) != tuple(binding.shape):
            raise ShapeError(f"write of shape {arr.shape} into a tensor of shape {binding.shape}")
        arr = arr.astype(to_numpy(binding.dtype), copy=False)
        view = self.host_view(binding)
        if view is not None:
            view[...] = arr
            return
        alloc: Allocation = binding.buffer.handle
        if binding.is_contiguous:
            self.upload_bytes(alloc, binding.offset, np.ascontiguousarray(arr).tobytes())
            return
        lo, hi = _span(binding)  # strided target: read the span, patch it, write it back
        raw = self.download_bytes(alloc, lo, hi - lo)
        numpy_view(raw, replace(binding, offset=binding.offset - lo))[...] = arr
        self.upload_bytes(alloc, lo, raw.tobytes())

    def read_into(self, binding: Binding, out: np.ndarray) -> None:
        view = self.host_view(binding)
        if view is not None:
            out[...] = view
            return
        lo, hi = _span(binding)
        raw = self.download_bytes(binding.buffer.handle, lo, hi - lo)
        out[...] = numpy_view(raw, replace(binding, offset=binding.offset - lo))

    def upload_bytes(self, alloc: Allocation, offset: int, data: bytes) -> None:
        """Host bytes -> device buffer at `offset` (mapped copy, or via a staging buffer)."""
        if not data:
            return
        if alloc.mapped is not None:
            alloc.mapped[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            return
        self._staged(alloc, offset, len(data), data)

    def download_bytes(self, alloc: Allocation, offset: int, nbytes: int) -> np.ndarray:
        """Device buffer bytes -> a fresh host uint8 array."""
        if nbytes <= 0:
            return np.zeros(0, np.uint8)
        if alloc.mapped is not None:
            return alloc.mapped[offset:offset + nbytes].copy()
        return self._staged(alloc, offset, nbytes, None)

    def _staged(self, alloc: Allocation, offset: int, nbytes: int, upload: bytes | None) -> np.ndarray:
        """One vkCmdCopyBuffer through a temporary host-visible staging buffer."""
        vk = self.vk
        with self._transfer_lock:
            staging = self.memory_pool.create(nbytes, staging=True, free_hint=self.memory().free)
            try:
                if upload is not None:
                    staging.mapped[:nbytes] = np.frombuffer(upload, dtype=np.uint8)
                cmd = self._xfer_cmd
                vk.vkResetCommandBuffer(cmd, 0)
                vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo(flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
                region = vk.VkBufferCopy(srcOffset=0 if upload is not None else offset,
                                         dstOffset=offset if upload is not None else 0, size=nbytes)
                before = vk.VkMemoryBarrier(srcAccessMask=0x40 | 0x1000 | 0x4000, dstAccessMask=0x800 | 0x1000)
                vk.vkCmdPipelineBarrier(cmd, 0x800 | 0x1000 | 0x4000, 0x1000, 0, 1, [before], 0, None, 0, None)
                if upload is not None:
                    vk.vkCmdCopyBuffer(cmd, staging.buffer, alloc.buffer, 1, [region])
                else:
                    vk.vkCmdCopyBuffer(cmd, alloc.buffer, staging.buffer, 1, [region])
                after = vk.VkMemoryBarrier(srcAccessMask=0x1000, dstAccessMask=0x2000 | 0x20 | 0x40)
                vk.vkCmdPipelineBarrier(cmd, 0x1000, 0x4000 | 0x800, 0, 1, [after], 0, None, 0, None)
                vk.vkEndCommandBuffer(cmd)
                self.submit_and_wait(cmd, self._xfer_fence)
                return staging.mapped[:nbytes].copy() if upload is None else np.zeros(0, np.uint8)
            finally:
                self.memory_pool.destroy(staging)

    def fill_zero(self, binding: Binding) -> None:
        if binding.is_contiguous and binding.nbytes and self.host_view(binding) is None:
            self.upload_bytes(binding.buffer.handle, binding.offset, bytes(binding.nbytes))
        else:
            super().fill_zero(binding)

    # -- compute ---------------------------------------------------------------------------
    def supports(self, node: Tensor) -> bool:
        return lowering.supports(node, self)

    def kernel_variants(self, op: str) -> tuple[str, ...]:
        """Workgroup / tile variants of `op` that fit this device, this device's default first
        (variants.py); an exporter times them and `SplitProgram.tuning[op]` selects one."""
        names = variants.names(op)
        if not names:
            return ()
        first = variants.default(op, self)
        table = variants.TABLES[op]
        return (first, *(n for n in names if n != first and variants.fits(table[n], self.info)))

    def compile(self, program: SplitProgram) -> PreparedSplit:
        from .split import VulkanPreparedSplit

        if self.closed:
            raise ReleasedError(f"device {self.name} is closed")
        split = VulkanPreparedSplit(self, program)
        with self._mem_lock:
            if self.closed:
                split.release()
                raise ReleasedError(f"device {self.name} is closed")
            self._splits.add(split)
        return split

    def build_pipelines(self, keys: list[Key]) -> tuple[list[Any], dict[str, Any]]:
        """The pipelines for a split's dispatches: the missing ones built in parallel, then
        (drivers that compile at first dispatch) primed. Returns them and what it cost."""
        start = time.perf_counter()
        before = self.pipelines.stats["built"]
        pipes = self.pipelines.ensure(keys)
        built = self.pipelines.stats["built"] - before
        primed = 0
        if self._prime_lanes:
            with self._prime_lock:  # one priming at a time; each pipeline once per device
                record = self._primed_record
                todo = [k for k in dict.fromkeys(keys) if k not in self._primed and (record is None or k not in record)]
                if todo:
                    done = prime(self, todo, self._prime_lanes)
                    self._primed.update(todo)  # a stopped priming is not retried: the first run compiles
                    if record is not None and done["primed"] == len(todo):
                        record.add(todo)
                    primed = done["primed"]
                    self.prime_stats["primed"] += primed
                    self.prime_stats["seconds"] += done["seconds"]
                    self.prime_stats["lanes"] = max(self.prime_stats["lanes"], done["lanes"])
        return pipes, {"pipelines": len(set(keys)), "pipelines_built": built, "pipelines_primed": primed,
                       "pipeline_seconds": round(time.perf_counter() - start, 4)}

    def _forget_split(self, split: PreparedSplit) -> None:
        self._splits.discard(split)

    def submit_and_wait(self, cmd: Any, fence: Any) -> None:
        """Submit one command buffer, wait for its fence, reset the fence (queue access is serialised)."""
        vk = self.vk
        cmds = [cmd]
        info = vk.VkSubmitInfo(commandBufferCount=1, pCommandBuffers=cmds)
        with self._queue_lock:
            vk.vkQueueSubmit(self.queue, 1, [info], fence)
            try:
                vk.vkWaitForFences(self.handle, 1, [fence], vk.VK_TRUE, 600 * 10**9)
            except vk.VkTimeout as exc:
                raise FlareError(f"{self.name}: a submission did not finish within 600 s") from exc
            finally:
                vk.vkResetFences(self.handle, 1, [fence])

    def synchronize(self) -> None:
        if self.handle is not None:
            with self._queue_lock:
                self.vk.vkQueueWaitIdle(self.queue)

    def live_objects(self) -> dict[str, int]:
        """Live VkBuffers, VkDeviceMemory, descriptor pools, command pools/buffers and fences.

        These return to their baseline once splits and buffers are released. The pipeline
        cache is not here: it grows on a kernel's first use and lives until close()
        (see `cache_objects`), so a leak check needs no warm-up run.
        """
        return {k: int(self.live[k]) for k in LIVE_KEYS}

    def cache_objects(self) -> dict[str, int]:
        """Pipelines, pipeline layouts, descriptor set layouts, shader modules and the VkPipelineCache, kept until close()."""
        return {k: int(self.live[k]) for k in CACHE_KEYS}

    def pipeline_stats(self) -> dict[str, Any]:
        """Pipelines built (and how many the driver found in the VkPipelineCache), build and
        priming seconds, and the cache file's state (loaded / missing / ignored: why)."""
        stats = dict(self.pipelines.stats)
        stats["build_seconds"] = round(stats["build_seconds"], 4)
        return {**stats, "primed": self.prime_stats["primed"], "prime_seconds": round(self.prime_stats["seconds"], 4),
                "prime_lanes": self.prime_stats["lanes"],
                "cache_file": self.disk_cache.describe() if self.disk_cache is not None else None}

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out.update(device=self.info.name, type=self.info.type_name, subgroup_size=self.info.subgroup_size,
                   mapped=self.mapped, force_staging=self.force_staging,
                   kernel_profile=self.kernel_profile, cache=self.cache_objects(), pipelines=self.pipeline_stats())
        return out

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Release splits still alive, free leftover buffers (with a warning), destroy caches, then the device.

        Executes in flight finish first (`_begin_close` waits for every `in_use`); later ones
        raise ReleasedError, and graphs released afterwards free nothing twice."""
        if self.closed or not self._begin_close():
            return
        with self._mem_lock:
            self.closed = True
            if self.handle is not None:
                with self._queue_lock:
                    self.vk.vkDeviceWaitIdle(self.handle)
            for split in list(self._splits):
                split.release()
            if self._allocs:
                warnings.warn(f"{self.name} closed with {len(self._allocs)} buffer(s) still allocated; freeing them",
                              ResourceWarning, stacklevel=2)
                for alloc in list(self._allocs.values()):
                    self.memory_pool.destroy(alloc)
                self._allocs.clear()
            self._destroy_device_objects()
        self.instance.release()

    def _destroy_device_objects(self) -> None:
        vk, dev = self.vk, self.handle
        if dev is None:
            return
        if getattr(self, "pipelines", None) is not None:
            self.pipelines.destroy()
        if getattr(self, "disk_cache", None) is not None:
            self.disk_cache.save()  # after every build returned (pipelines.destroy took the build lock)
            if self._primed_record is not None:
                self._primed_record.save()
            self.disk_cache.destroy()
            self.live["pipeline_caches"] -= 1
            self.disk_cache = None
        if getattr(self, "_xfer_fence", None) is not None:
            vk.vkDestroyFence(dev, self._xfer_fence, None)
            self.live["fences"] -= 1
            self._xfer_fence = None
        if getattr(self, "_xfer_pool", None) is not None:
            if getattr(self, "_xfer_cmd", None) is not None:
                vk.vkFreeCommandBuffers(dev, self._xfer_pool, 1, [self._xfer_cmd])
                self.live["command_buffers"] -= 1
                self._xfer_cmd = None
            vk.vkDestroyCommandPool(dev, self._xfer_pool, None)
            self.live["command_pools"] -= 1
            self._xfer_pool = None
        vk.vkDestroyDevice(dev, None)
        self.handle = None


def _span(binding: Binding) -> tuple[int, int]:
    """Byte range [lo, hi) the binding addresses inside its buffer."""
    item = binding.itemsize
    if not all(binding.shape):
        return binding.offset, binding.offset
    hi = binding.offset + (1 + sum((d - 1) * s for d, s in zip(binding.shape, binding.strides))) * item
    return binding.offset, hi
