"""Make a driver that compiles pipelines at their first dispatch compile them now, in parallel.

Measured with empty caches on lavapipe (Mesa 22.3, LLVM 15; profile in the README): its
vkCreateComputePipelines only translates SPIR-V to NIR (20-150 ms); LLVM compiles the
pipeline to machine code on the queue's one thread at its first dispatch, 0.3-6 s for each
variant of the lane matmul, one after another. A cold `flare run silero-vad --backend
vulkan` spent 27.5 of its 31 s inside the first execute's vkWaitForFences, compiling 11
pipelines (4 of them 3-6 s each); warm, Mesa's own shader cache ($XDG_CACHE_HOME) answers
in milliseconds.

Priming moves that compile to prepare time and spreads it over the CPUs: every new
pipeline gets one *empty* dispatch (group count 0, valid Vulkan: no invocation runs, but
the driver compiles the variant it would run), each on one of several lanes, a worker
thread per lane. Lane 0 is the device's own queue (what it compiles lands in the pipeline
itself); the others are helper VkDevices of the same physical device, each with its own
queue thread in the driver. A helper builds its own copy of the pipeline; lavapipe writes
what the helper compiles into Mesa's shader cache, shared by every device of the process
(and the next process), where the device's own first dispatch finds it. So helpers are
used only where that cache is on (`MESA_SHADER_CACHE_DISABLE` unset); without it there is
nothing to gain and nothing is primed.

What the threads share: nothing Vulkan but the physical device and, for lane 0, the
device's queue, which `VulkanDevice.submit_and_wait` serialises. Every lane's objects
(command pool and buffer, fence, descriptor pool, a 256-byte buffer bound to every
binding, the helper device itself) are created before the threads start and destroyed
after they have all returned, on the calling thread, so the device's object counters are
only touched there. Priming is an optimisation: a Vulkan error in it stops it (logged at
debug level) and the compile simply happens at the first execute, as before.

A warm process skips all of that: which pipelines were primed is kept in a small record
beside the pipeline cache file (`PrimedRecord`: one hash of SPIR-V + constants a line), and
a recorded pipeline is taken to be in the driver's cache. If that cache was wiped but
Flare's was not, the first execute compiles it, as without priming.

Other drivers compile inside vkCreateComputePipelines, which `pipelines.py` already runs
in parallel threads; priming is off for them (`prime` config / FLARE_VULKAN_PRIME=1 forces
it on, =0 off).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from flare.core.cache import write_atomic

from .memory import Memory, MemoryTypes
from .pipelines import SHADER_DIR, SHADERS, Key, Pipelines, build_workers

if TYPE_CHECKING:
    from .device import VulkanDevice

log = logging.getLogger("flare.backends.vulkan")

ENV_PRIME = "FLARE_VULKAN_PRIME"
DRIVER_ID_MESA_LLVMPIPE = 13  # VkDriverId
DUMMY_BYTES = 256


def defers_compile(info: Any) -> bool:
    """Whether this driver compiles pipelines at first dispatch (lavapipe / llvmpipe)."""
    return info.driver_id == DRIVER_ID_MESA_LLVMPIPE or "llvmpipe" in info.name.lower()


def mesa_cache_enabled() -> bool:
    for var in ("MESA_SHADER_CACHE_DISABLE", "MESA_GLSL_CACHE_DISABLE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return False
    return True


def prime_mode(info: Any, setting: Any) -> int:
    """How many lanes priming may use: 0 = off. `setting`: config `prime` / FLARE_VULKAN_PRIME
    (unset or "auto": on for lavapipe with Mesa's shader cache; 1/true: on; 0/false: off)."""
    text = "auto" if setting is None else str(setting).strip().lower()
    if text in ("0", "false", "no", "off"):
        return 0
    if text in ("", "auto"):
        if not (defers_compile(info) and mesa_cache_enabled()):
            return 0
    elif text not in ("1", "true", "yes", "on"):
        from flare.core.errors import InputError

        raise InputError(f"prime={setting!r}: expected auto, 1/0, true/false, yes/no or on/off")
    return build_workers()


MAX_RECORDED = 8192
_SPV_DIGESTS: dict[str, str] = {}


def key_digest(key: Key) -> str:
    """A pipeline's identity across processes: hash of its SPIR-V bytes and constants."""
    shader, spec = key
    spv = _SPV_DIGESTS.get(shader)
    if spv is None:
        spv = _SPV_DIGESTS[shader] = hashlib.sha256((SHADER_DIR / f"{shader}.spv").read_bytes()).hexdigest()
    return hashlib.sha256(f"{spv}:{','.join(map(str, spec))}".encode()).hexdigest()[:32]


def mesa_cache_location() -> str:
    """Where Mesa keeps its shader cache (MESA_SHADER_CACHE_DIR, else $XDG_CACHE_HOME, else ~/.cache)."""
    return os.path.abspath(os.environ.get("MESA_SHADER_CACHE_DIR") or os.environ.get("MESA_GLSL_CACHE_DIR")
                           or os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"))


def record_path(info: Any, folder: Path) -> Path:
    """The record for this device, driver version and Mesa cache folder (another folder is another cache)."""
    where = hashlib.sha256(mesa_cache_location().encode()).hexdigest()[:12]
    return folder / f"primed-{bytes(info.device_uuid).hex()}-{int(info.driver_version):x}-{where}.txt"


class PrimedRecord:
    """Which pipelines were primed on this driver before (a file of digests, one a line).

    Read at device open, written at close like the pipeline cache (temp file + rename);
    unreadable or malformed lines are ignored, and an I/O error only costs priming again."""

    def __init__(self, path: Path):
        self.path = path
        self.done: set[str] = set()
        self._dirty = False
        try:
            text = path.read_text(encoding="ascii", errors="replace")
        except OSError:
            return
        self.done = {line.strip() for line in text.splitlines()
                     if len(line.strip()) == 32 and all(c in "0123456789abcdef" for c in line.strip())}

    def __contains__(self, key: Key) -> bool:
        return key_digest(key) in self.done

    def add(self, keys: Sequence[Key]) -> None:
        new = {key_digest(k) for k in keys} - self.done
        if new:
            self.done |= new
            self._dirty = True

    def save(self) -> None:
        if not self._dirty or len(self.done) > MAX_RECORDED:
            return
        try:
            write_atomic(self.path, "".join(f"{d}\n" for d in sorted(self.done)).encode("ascii"))
            self._dirty = False
        except OSError as exc:
            log.debug("%s: cannot write the primed record (%s)", self.path, exc)


def _cost(key: Key) -> tuple[int, int]:
    """Rough compile cost, to hand out the big ones first: SPIR-V size, then (lane matmul)
    whether the K % 4 tail loop is compiled in (MODE bit 32 clear) and a is read by scalars
    (bit 1 clear), each about a third more LLVM time (measured, see the README)."""
    try:
        size = (SHADER_DIR / f"{key[0]}.spv").stat().st_size
    except OSError:
        size = 0
    mode = int(key[1][0]) if key[1] else 0
    extra = (not mode & 32) + (not mode & 1) if key[0] == "matmul_lanes" else 0
    return size, extra


class _Lane:
    """One queue that primes: the device's own (helper=False) or a helper VkDevice's."""

    def __init__(self, device: "VulkanDevice", helper: bool, n_sets: int):
        self.device = device
        self.vk = device.vk
        self.helper = helper
        self.handle = self.queue = self.pool = self.cmd_pool = self.cmd = self.fence = self.buf = None
        self.pipelines: Pipelines | None = None
        self.live: Counter = Counter()  # the helper's own counts; lane 0 uses the device's
        self.count = 0
        try:
            self._create(n_sets)
        except BaseException:
            self.close()
            raise

    def _create(self, n_sets: int) -> None:
        device, vk, helper = self.device, self.vk, self.helper
        if helper:
            info = device.info
            prio = vk.ffi.new("float[1]", [1.0])
            qinfo = vk.VkDeviceQueueCreateInfo(queueFamilyIndex=device.queue_family, queueCount=1, pQueuePriorities=prio)
            self.handle = vk.vkCreateDevice(info.handle, vk.VkDeviceCreateInfo(queueCreateInfoCount=1,
                                                                                pQueueCreateInfos=[qinfo]), None)
            self.queue = vk.vkGetDeviceQueue(self.handle, device.queue_family, 0)
            self.memory = Memory(vk, self.handle, f"{device.name}:prime", MemoryTypes(info, False), self.live)
            self.pipelines = Pipelines(vk, self.handle, self.live, workers=1)
        else:
            self.live = device.live
            self.handle = device.handle
            self.memory = device.memory_pool
            self.pipelines = device.pipelines
        dev = self.handle
        self.buf = self.memory.create(DUMMY_BYTES)
        size = vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                       descriptorCount=n_sets * (max(SHADERS.values()) + 1))
        self.pool = vk.vkCreateDescriptorPool(dev, vk.VkDescriptorPoolCreateInfo(maxSets=n_sets, poolSizeCount=1,
                                                                                 pPoolSizes=[size]), None)
        self.live["descriptor_pools"] += 1
        self.cmd_pool = vk.vkCreateCommandPool(dev, vk.VkCommandPoolCreateInfo(
            queueFamilyIndex=device.queue_family, flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)
        self.live["command_pools"] += 1
        self.cmd = vk.vkAllocateCommandBuffers(dev, vk.VkCommandBufferAllocateInfo(
            commandPool=self.cmd_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
        self.live["command_buffers"] += 1
        self.fence = vk.vkCreateFence(dev, vk.VkFenceCreateInfo(), None)
        self.live["fences"] += 1

    def prime(self, key: Key) -> None:
        """One empty dispatch of `key`'s pipeline, waited for (worker thread)."""
        vk, dev = self.vk, self.handle
        pipe = self.pipelines.get(*key)
        ds = vk.vkAllocateDescriptorSets(dev, vk.VkDescriptorSetAllocateInfo(
            descriptorPool=self.pool, descriptorSetCount=1, pSetLayouts=[pipe.set_layout]))[0]
        infos = [vk.VkDescriptorBufferInfo(buffer=self.buf.buffer, offset=0, range=self.buf.size)
                 for _ in range(pipe.n_buffers + 1)]
        writes = [vk.VkWriteDescriptorSet(dstSet=ds, dstBinding=i, dstArrayElement=0, descriptorCount=1,
                                          descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, pBufferInfo=[bi])
                  for i, bi in enumerate(infos)]
        vk.vkUpdateDescriptorSets(dev, len(writes), writes, 0, None)
        cmd = self.cmd
        vk.vkResetCommandBuffer(cmd, 0)
        vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo(flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
        vk.vkCmdBindPipeline(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe.handle)
        vk.vkCmdBindDescriptorSets(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe.layout, 0, 1, [ds], 0, None)
        vk.vkCmdPushConstants(cmd, pipe.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, 4, vk.ffi.new("uint32_t[1]", [0]))
        vk.vkCmdDispatch(cmd, 0, 0, 0)  # no workgroups: nothing runs, the variant is compiled
        vk.vkEndCommandBuffer(cmd)
        if self.helper:
            vk.vkQueueSubmit(self.queue, 1, [vk.VkSubmitInfo(commandBufferCount=1, pCommandBuffers=[cmd])], self.fence)
            try:
                vk.vkWaitForFences(dev, 1, [self.fence], vk.VK_TRUE, 600 * 10**9)
            finally:
                vk.vkResetFences(dev, 1, [self.fence])
        else:
            self.device.submit_and_wait(cmd, self.fence)
        self.count += 1

    def close(self) -> None:
        """Destroy in reverse order of creation (then the helper device); safe after a partial __init__."""
        vk, dev = self.vk, self.handle
        if dev is None:
            return
        if self.helper:
            vk.vkDeviceWaitIdle(dev)
        if self.fence is not None:
            vk.vkDestroyFence(dev, self.fence, None)
            self.live["fences"] -= 1
        if self.cmd is not None:
            vk.vkFreeCommandBuffers(dev, self.cmd_pool, 1, [self.cmd])
            self.live["command_buffers"] -= 1
        if self.cmd_pool is not None:
            vk.vkDestroyCommandPool(dev, self.cmd_pool, None)
            self.live["command_pools"] -= 1
        if self.pool is not None:
            vk.vkDestroyDescriptorPool(dev, self.pool, None)
            self.live["descriptor_pools"] -= 1
        if self.buf is not None:
            self.memory.destroy(self.buf)
        self.fence = self.cmd = self.cmd_pool = self.pool = self.buf = None
        if self.helper:
            if self.pipelines is not None:
                self.pipelines.destroy()
            vk.vkDestroyDevice(dev, None)
        self.handle = None


def prime(device: "VulkanDevice", keys: Sequence[Key], lanes: int) -> dict[str, Any]:
    """Empty-dispatch every pipeline of `keys` (already built on `device`), spread over up to
    `lanes` queues; returns what it did (primed count, lanes, seconds)."""
    keys = sorted(dict.fromkeys(keys), key=_cost, reverse=True)
    if not keys or lanes <= 0:
        return {"primed": 0, "lanes": 0, "seconds": 0.0}
    start = time.perf_counter()
    n_lanes = min(lanes, len(keys)) if mesa_cache_enabled() else 1
    made: list[_Lane] = []
    try:
        for i in range(n_lanes):
            try:
                made.append(_Lane(device, helper=i > 0, n_sets=len(keys)))
            except Exception as exc:  # e.g. the driver refuses another VkDevice: prime with fewer lanes
                log.debug("%s: no priming lane %d (%s)", device.name, i, exc)
                break
        todo = list(keys)
        todo_lock = threading.Lock()
        errors: list[Exception] = []

        def work(lane: _Lane) -> None:
            while True:
                with todo_lock:
                    if not todo or errors:
                        return
                    key = todo.pop(0)
                try:
                    lane.prime(key)
                except Exception as exc:  # stop priming; the first execute compiles what is left
                    with todo_lock:
                        errors.append(exc)
                    return

        threads = [threading.Thread(target=work, args=(lane,), name=f"flare-vk-prime-{i}", daemon=True)
                   for i, lane in enumerate(made[1:], 1)]
        try:
            for t in threads:
                t.start()
            if made:
                work(made[0])  # lane 0 on the calling thread
        finally:  # also on KeyboardInterrupt: the others finish their current key, then stop
            with todo_lock:
                todo.clear()
            for t in threads:
                if t.ident is not None:  # started
                    t.join()
        if errors:
            log.debug("%s: priming stopped: %s", device.name, errors[0])
    finally:
        for lane in made:
            lane.close()
    return {"primed": sum(lane.count for lane in made), "lanes": len(made),
            "seconds": time.perf_counter() - start}
