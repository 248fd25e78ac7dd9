"""Device memory: VkBuffer + VkDeviceMemory pairs, the choice of memory type, and staging copies.

Two ways bytes reach a buffer:
- *mapped*: the buffer lives in memory that is device local **and** host visible and
  coherent (integrated GPUs, lavapipe, resizable BAR); it is mapped once for its whole
  life and the host reads and writes it through a NumPy view;
- *staged*: the buffer lives in device-local memory the host cannot see (discrete
  GPUs); `write`/`read_into` go through a temporary host-visible staging buffer and
  `vkCmdCopyBuffer`. `force_staging` selects this path even where mapping would work,
  so the path is tested on lavapipe.

Every failure to allocate becomes `AllocationError` after undoing what the attempt
created: a half-made buffer is never returned and never leaked.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from flare.core.errors import AllocationError

from .loader import PhysicalDeviceInfo

DEVICE_LOCAL = 0x1
HOST_VISIBLE = 0x2
HOST_COHERENT = 0x4
HEAP_DEVICE_LOCAL = 0x1


@dataclass
class Allocation:
    """One VkBuffer bound to its own VkDeviceMemory (whole-buffer bindings only)."""

    buffer: Any
    memory: Any
    size: int
    mapped: np.ndarray | None  # uint8 view of the persistently mapped memory, or None (staged)
    _cbuf: Any = None  # the cffi buffer behind `mapped`; kept alive while mapped


class MemoryTypes:
    """Which memory type device buffers and staging buffers use on one physical device."""

    def __init__(self, info: PhysicalDeviceInfo, force_staging: bool):
        self.info = info
        types = info.memory_types
        heaps = info.memory_heaps
        local = [i for i, (flags, _) in enumerate(types) if flags & DEVICE_LOCAL]
        if not local:  # some software drivers have no device-local type: all memory is "the device"
            local = list(range(len(types)))
        biggest_local_heap = max(heaps[types[i][1]][0] for i in local)
        mappable = [i for i in local if (types[i][0] & (HOST_VISIBLE | HOST_COHERENT)) == (HOST_VISIBLE | HOST_COHERENT)
                    and heaps[types[i][1]][0] == biggest_local_heap]  # not a small BAR window
        self.mapped = bool(mappable) and not force_staging
        # order of preference; the buffer's memoryTypeBits filter decides among them
        self.device_order = (mappable + [i for i in local if i not in mappable]) if self.mapped else \
            ([i for i in local if not types[i][0] & HOST_VISIBLE] + [i for i in local if types[i][0] & HOST_VISIBLE])
        self.staging_order = [i for i, (flags, _) in enumerate(types)
                              if (flags & (HOST_VISIBLE | HOST_COHERENT)) == (HOST_VISIBLE | HOST_COHERENT)]
        self.device_heap = types[self.device_order[0]][1]

    @staticmethod
    def pick(order: list[int], type_bits: int) -> int | None:
        for i in order:
            if type_bits & (1 << i):
                return i
        return None


class Memory:
    """Creates and destroys allocations for one VkDevice and counts what is live."""

    USAGE_BITS = 0x20 | 0x1 | 0x2  # STORAGE_BUFFER | TRANSFER_SRC | TRANSFER_DST

    def __init__(self, vk: Any, device: Any, name: str, types: MemoryTypes, live: Counter):
        self.vk = vk
        self.device = device
        self.name = name
        self.types = types
        self.live = live

    def create(self, nbytes: int, *, staging: bool = False, free_hint: int = 0) -> Allocation:
        """A buffer of `nbytes` (device memory, or host-visible staging memory)."""
        vk = self.vk
        # whole 4-byte words: shaders read f16 pairs as one uint, so a tensor with an odd
        # number of halves at the end of its buffer must not make that read run past the end
        nbytes = max(-(-int(nbytes) // 4) * 4, 4)
        info = vk.VkBufferCreateInfo(size=nbytes, usage=self.USAGE_BITS, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE)
        try:
            buffer = vk.vkCreateBuffer(self.device, info, None)
        except (vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory) as exc:
            raise AllocationError(self.name, nbytes, free_hint, f"vkCreateBuffer: {type(exc).__name__}") from None
        self.live["buffers"] += 1
        memory = None
        try:
            reqs = vk.vkGetBufferMemoryRequirements(self.device, buffer)
            order = self.types.staging_order if staging else self.types.device_order
            type_index = self.types.pick(order, int(reqs.memoryTypeBits))
            if type_index is None:
                raise AllocationError(self.name, nbytes, free_hint, "no memory type fits this buffer")
            alloc_info = vk.VkMemoryAllocateInfo(allocationSize=int(reqs.size), memoryTypeIndex=type_index)
            try:
                memory = vk.vkAllocateMemory(self.device, alloc_info, None)
            except (vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory, vk.VkErrorTooManyObjects) as exc:
                raise AllocationError(self.name, nbytes, free_hint, f"vkAllocateMemory: {type(exc).__name__}") from None
            self.live["memories"] += 1
            vk.vkBindBufferMemory(self.device, buffer, memory, 0)
            mapped = cbuf = None
            if staging or self.types.mapped:
                try:
                    cbuf = vk.vkMapMemory(self.device, memory, 0, nbytes, 0)  # explicit size: VK_WHOLE_SIZE is -1 here
                except vk.VkError as exc:
                    raise AllocationError(self.name, nbytes, free_hint, f"vkMapMemory: {type(exc).__name__}") from None
                mapped = np.frombuffer(cbuf, dtype=np.uint8, count=nbytes)
            return Allocation(buffer, memory, nbytes, mapped, cbuf)
        except BaseException:
            if memory is not None:
                vk.vkFreeMemory(self.device, memory, None)
                self.live["memories"] -= 1
            vk.vkDestroyBuffer(self.device, buffer, None)
            self.live["buffers"] -= 1
            raise

    def destroy(self, alloc: Allocation) -> None:
        """Unmap (if mapped), destroy the buffer, free its memory; idempotent per allocation."""
        vk = self.vk
        if alloc.buffer is None:
            return
        if alloc.mapped is not None:
            alloc.mapped = None
            alloc._cbuf = None
            vk.vkUnmapMemory(self.device, alloc.memory)
        vk.vkDestroyBuffer(self.device, alloc.buffer, None)
        self.live["buffers"] -= 1
        vk.vkFreeMemory(self.device, alloc.memory, None)
        self.live["memories"] -= 1
        alloc.buffer = alloc.memory = None
