"""A compiled split: one recorded command buffer replayed by every `run()`.

`compile` lowers the split's nodes to dispatches, writes all their tensor descriptors and
parameters into one metadata buffer owned by the split, allocates one descriptor set per
dispatch from a pool owned by the split, and records a single command buffer: every
dispatch, with a pipeline barrier only where a dispatch touches bytes that an earlier,
not yet synchronised dispatch wrote (read-after-write, write-after-write) or read
(write-after-read). `run` submits it and waits on the split's fence, so nothing is
recorded on the hot path. New bindings or shapes mean a new compile (the caller's job).

Data buffers belong to the caller (the PreparedGraph); the split owns only its metadata
buffer, descriptor pool, command pool/buffer and fence, and `release` frees exactly those.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from flare.core.backend import PreparedSplit, SplitProgram
from flare.core.errors import FlareError, ReleasedError

from . import fusion, lowering, sharing
from .lowering import Dispatch

if TYPE_CHECKING:
    from .device import VulkanDevice

FENCE_TIMEOUT_NS = 600 * 10**9

# access / stage bits (the values are fixed by the Vulkan spec)
SHADER_READ, SHADER_WRITE = 0x20, 0x40
TRANSFER_READ, TRANSFER_WRITE = 0x800, 0x1000
HOST_READ, HOST_WRITE = 0x2000, 0x4000
STAGE_COMPUTE, STAGE_TRANSFER, STAGE_HOST = 0x800, 0x1000, 0x4000


class VulkanPreparedSplit(PreparedSplit):
    """The captured program of one split on one Vulkan device."""

    def __init__(self, device: "VulkanDevice", program: SplitProgram, *, record: bool = True):
        self.device = device
        self.vk = device.vk
        self.program = program
        self.released = False
        self._lock = threading.Lock()
        self.meta = None  # flare Buffer
        self.pool = self.cmd_pool = self.cmd = self.fence = None
        self.sets: list[Any] = []
        self.stats = {"dispatches": 0, "barriers": 0}
        self.build_info: dict[str, Any] = {}
        try:
            self.dispatches = self._lower(program)
            if self.dispatches:
                self._write_meta()
                # only the pipelines these dispatches use; the missing ones built in parallel
                self.pipelines, self.build_info = device.build_pipelines([(d.shader, d.spec) for d in self.dispatches])
                self._descriptors()
                self._update_descriptors()
                self._create_commands()
                if record:
                    self.record()
        except BaseException:
            self.release()
            raise

    # -- building ----------------------------------------------------------------------
    def _lower(self, program: SplitProgram) -> list[Dispatch]:
        out: list[Dispatch] = []
        for node in program.nodes:
            try:
                dispatches = lowering.lower(node, program, self.device)
            except lowering.Unsupported as exc:
                raise FlareError(f"node {node.name!r} ({node.op}) cannot run on {self.device.name}: {exc}") from None
            for d in dispatches:
                for a in d.args:
                    if a.binding.buffer.device is not self.device:
                        raise FlareError(f"node {node.name!r}: a tensor is bound to {a.binding.buffer.device.name}, "
                                         f"not {self.device.name}")
                    if a.binding.buffer.released:
                        raise ReleasedError(f"node {node.name!r}: a bound buffer was already released")
            out += dispatches
        out = fusion.chain_elementwise(out, self.device.info.max_storage_buffers_per_stage)
        out = sharing.share_lane_variants(out)
        self.stats["dispatches"] = len(out)
        return out

    def _write_meta(self) -> None:
        """All dispatches' descriptors and parameters into the split's metadata buffer
        (reused when the new words fit, e.g. on rebind)."""
        words: list[int] = []
        self.meta_base: list[int] = []
        for d in self.dispatches:
            self.meta_base.append(len(words))
            words += d.meta_words()
        data = np.asarray(words, dtype=np.uint32)
        if self.meta is None or self.meta.nbytes < data.nbytes:
            new = self.device.alloc(data.nbytes, tag="vulkan:split-meta")
            if self.meta is not None:
                self.meta.release()
            self.meta = new
        self.device.upload_bytes(self.meta.handle, 0, data.tobytes())

    def _descriptors(self) -> None:
        vk, dev = self.vk, self.device.handle
        live = self.device.live
        n_desc = sum(len(d.bound()) + 1 for d in self.dispatches)
        size = vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=n_desc)
        info = vk.VkDescriptorPoolCreateInfo(maxSets=len(self.dispatches), poolSizeCount=1, pPoolSizes=[size])
        self.pool = vk.vkCreateDescriptorPool(dev, info, None)
        live["descriptor_pools"] += 1
        layouts = [p.set_layout for p in self.pipelines]
        alloc = vk.VkDescriptorSetAllocateInfo(descriptorPool=self.pool, descriptorSetCount=len(layouts), pSetLayouts=layouts)
        sets = vk.vkAllocateDescriptorSets(dev, alloc)
        self.sets = [sets[i] for i in range(len(layouts))]

    def _update_descriptors(self) -> None:
        vk, dev = self.vk, self.device.handle
        infos = []  # keep every struct alive until vkUpdateDescriptorSets returns
        writes = []
        meta = self.meta.handle
        for d, ds in zip(self.dispatches, self.sets):
            bufs = [(meta.buffer, meta.size)] + [(b.handle.buffer, b.handle.size) for b in d.bound()]
            for i, (buf, size_) in enumerate(bufs):
                bi = vk.VkDescriptorBufferInfo(buffer=buf, offset=0, range=size_)  # whole buffer; VK_WHOLE_SIZE is -1 here
                infos.append(bi)
                writes.append(vk.VkWriteDescriptorSet(dstSet=ds, dstBinding=i, dstArrayElement=0, descriptorCount=1,
                                                      descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, pBufferInfo=[bi]))
        vk.vkUpdateDescriptorSets(dev, len(writes), writes, 0, None)

    def _create_commands(self) -> None:
        vk, dev = self.vk, self.device.handle
        live = self.device.live
        pool_info = vk.VkCommandPoolCreateInfo(queueFamilyIndex=self.device.queue_family,
                                               flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT)
        self.cmd_pool = vk.vkCreateCommandPool(dev, pool_info, None)
        live["command_pools"] += 1
        alloc = vk.VkCommandBufferAllocateInfo(commandPool=self.cmd_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                                               commandBufferCount=1)
        self.cmd = vk.vkAllocateCommandBuffers(dev, alloc)[0]
        live["command_buffers"] += 1
        self.fence = vk.vkCreateFence(dev, vk.VkFenceCreateInfo(), None)
        live["fences"] += 1

    def record(self) -> None:
        """(Re)record the command buffer: dispatches with barriers only between dependent ones."""
        vk = self.vk
        cmd = self.cmd
        vk.vkResetCommandBuffer(cmd, 0)
        vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo())
        # earlier submissions (other splits, staging copies) and host writes -> our shaders
        self._global_barrier(cmd, STAGE_COMPUTE | STAGE_TRANSFER | STAGE_HOST, STAGE_COMPUTE,
                             SHADER_WRITE | TRANSFER_WRITE | HOST_WRITE, SHADER_READ | SHADER_WRITE)
        pending_w: list[tuple[int, int, int, Any, int]] = []  # (key, lo, hi, VkBuffer, size)
        pending_r: list[tuple[int, int, int]] = []
        barriers = 0
        bound = None
        for d, pipe, ds, base in zip(self.dispatches, self.pipelines, self.sets, self.meta_base):
            reads, writes = [], []
            for i, a in enumerate(d.args):
                lo, hi = a.byte_range()
                alloc = a.binding.buffer.handle
                entry = (id(alloc), lo, hi, alloc.buffer, alloc.size)
                (writes if i in d.writes else reads).append(entry)
            if (_overlaps(reads + writes, pending_w) or _overlaps(writes, pending_r)):
                self._buffer_barrier(cmd, pending_w)
                barriers += 1
                pending_w, pending_r = [], []
            if bound is not pipe:
                vk.vkCmdBindPipeline(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe.handle)
                bound = pipe
            vk.vkCmdBindDescriptorSets(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe.layout, 0, 1, [ds], 0, None)
            push = vk.ffi.new("uint32_t[1]", [base])
            vk.vkCmdPushConstants(cmd, pipe.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, 4, push)
            vk.vkCmdDispatch(cmd, *d.groups)
            pending_w += writes
            pending_r += [r[:3] for r in reads]
        # our writes -> host reads after the fence, staging copies, and later submissions
        self._global_barrier(cmd, STAGE_COMPUTE, STAGE_HOST | STAGE_TRANSFER | STAGE_COMPUTE,
                             SHADER_WRITE, HOST_READ | TRANSFER_READ | SHADER_READ | SHADER_WRITE)
        vk.vkEndCommandBuffer(cmd)
        self.stats["barriers"] = barriers

    def _global_barrier(self, cmd: Any, src_stage: int, dst_stage: int, src_access: int, dst_access: int) -> None:
        vk = self.vk
        mb = vk.VkMemoryBarrier(srcAccessMask=src_access, dstAccessMask=dst_access)
        vk.vkCmdPipelineBarrier(cmd, src_stage, dst_stage, 0, 1, [mb], 0, None, 0, None)

    def _buffer_barrier(self, cmd: Any, pending_w: list[tuple[int, int, int, Any, int]]) -> None:
        vk = self.vk
        spans: dict[int, list] = {}
        for key, lo, hi, buf, size in pending_w:
            s = spans.get(key)
            spans[key] = [min(s[0], lo), max(s[1], hi), buf] if s else [lo, hi, buf]
        barriers = [vk.VkBufferMemoryBarrier(
            srcAccessMask=SHADER_WRITE, dstAccessMask=SHADER_READ | SHADER_WRITE,
            srcQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED, dstQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED,
            buffer=buf, offset=lo, size=max(hi - lo, 1)) for lo, hi, buf in spans.values()]
        # with no pending writes this is a pure execution dependency (write-after-read)
        vk.vkCmdPipelineBarrier(cmd, STAGE_COMPUTE, STAGE_COMPUTE, 0, 0, None,
                                len(barriers), barriers if barriers else None, 0, None)

    def describe(self) -> dict[str, Any]:
        """Dispatches and barriers recorded, and the pipelines this split's compile built / primed
        and the seconds it spent on them (0 built: all were cached on the device already)."""
        return {**self.stats, **self.build_info}

    # -- lifecycle ------------------------------------------------------------------------
    def rebind(self, program: SplitProgram) -> bool:
        """Point this split at new bindings of the same nodes (workspace growth, grown inputs).

        Possible when the nodes lower to the same shaders and constants: the metadata is
        rewritten (in the same buffer when it fits), the descriptor sets are updated in
        place and the command buffer is recorded again (its grid and barriers may change);
        pools, fence and pipelines are kept. Returns False (nothing changed) otherwise.
        """
        if self.released or program.device is not self.device:
            return False
        if [n.id for n in program.nodes] != [n.id for n in self.program.nodes]:
            return False
        try:
            dispatches = self._lower(program)
        except FlareError:
            return False
        if [(d.shader, d.spec) for d in dispatches] != [(d.shader, d.spec) for d in self.dispatches]:
            self.stats["dispatches"] = len(self.dispatches)
            return False
        self.program, self.dispatches = program, dispatches
        if dispatches:
            self._write_meta()  # an AllocationError here propagates; the caller releases this split
            self._update_descriptors()
            self.record()
        return True

    def run(self) -> None:
        """Submit the recorded command buffer and wait for it to finish."""
        if self.released:
            raise ReleasedError("this Vulkan split was released")
        if not self.dispatches:
            return
        self.device.submit_and_wait(self.cmd, self.fence)

    def run_rerecorded(self) -> None:
        """Record again, then run: what every execute would cost without capture (benchmarks)."""
        if self.released:
            raise ReleasedError("this Vulkan split was released")
        if self.dispatches:
            self.record()
            self.device.submit_and_wait(self.cmd, self.fence)

    def release(self) -> None:
        """Free descriptor pool, command buffer and pool, fence, then the metadata buffer; idempotent.

        Holds the device's memory lock, so a concurrent `VulkanDevice.close` never destroys
        the device between these calls."""
        with self.device._mem_lock:
            with self._lock:
                if self.released:
                    return
                self.released = True
            self._destroy()

    def _destroy(self) -> None:
        vk, dev, live = self.vk, self.device.handle, self.device.live
        if dev is None:  # the device was closed first and already destroyed everything
            self.meta = None
            return
        if self.pool is not None:
            vk.vkDestroyDescriptorPool(dev, self.pool, None)  # frees its sets
            live["descriptor_pools"] -= 1
            self.pool, self.sets = None, []
        if self.cmd is not None:
            vk.vkFreeCommandBuffers(dev, self.cmd_pool, 1, [self.cmd])
            live["command_buffers"] -= 1
            self.cmd = None
        if self.cmd_pool is not None:
            vk.vkDestroyCommandPool(dev, self.cmd_pool, None)
            live["command_pools"] -= 1
            self.cmd_pool = None
        if self.fence is not None:
            vk.vkDestroyFence(dev, self.fence, None)
            live["fences"] -= 1
            self.fence = None
        if self.meta is not None:
            self.meta.release()
            self.meta = None
        self.device._forget_split(self)


def _overlaps(a: list, b: list) -> bool:
    for ka, lo_a, hi_a, *_ in a:
        for kb, lo_b, hi_b, *_ in b:
            if ka == kb and lo_a < hi_b and lo_b < hi_a:
                return True
    return False
