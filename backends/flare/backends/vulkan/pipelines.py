"""Shader modules, descriptor set layouts and compute pipelines, cached for a device's life.

Every Flare shader has the same interface (see shaders/common.glsl): binding 0 is the
metadata buffer, bindings 1..n are whole data buffers, one push constant (the
dispatch's first metadata word), and specialization constants 0..4 (MODE and the four
dtypes), followed by the shader's own (workgroup and tile sizes, ids 5 and up). So a
descriptor set layout depends only on the shader's binding count, and a pipeline on
(shader, specialization constants).

Only the pipelines a split's dispatches use are built (so specialization variants no graph
uses are never compiled), when the split is compiled, all of its missing ones at once in
parallel threads, and reused by every split compiled afterwards; `destroy()` (device
close) frees them. Most drivers compile SPIR-V to machine code inside
vkCreateComputePipelines; lavapipe only translates it to NIR there and runs LLVM at the
pipeline's first dispatch, which `prime.py` moves to prepare time.
"""
from __future__ import annotations

import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

SHADER_DIR = Path(__file__).resolve().parent / "shaders"
N_SPEC = 5

# shader name -> number of data buffers (bindings 1..n); binding 0 is the metadata buffer
SHADERS: dict[str, int] = {
    "eltwise": 3, "eltwise_chain": 6, "copy": 3, "matmul": 5, "matmul_generic": 5, "matvec": 5, "rownorm": 4, "reduce": 2,
    "get_rows": 3, "set_rows": 3, "gather": 3, "rope": 3, "conv1d": 3, "top_k": 2, "mul_mat_id": 4, "attention": 5,
    "lstm": 5, "matmul_lanes": 5,
    "dequant": 3, "matvec_q": 5, "matmul_q": 5, "matmul_q_lanes": 5,  # block-quantized weights (quant.glsl)
}


class Pipeline:
    """A compute pipeline with the layouts a dispatch needs to bind it."""

    def __init__(self, handle: Any, layout: Any, set_layout: Any, n_buffers: int):
        self.handle = handle
        self.layout = layout
        self.set_layout = set_layout
        self.n_buffers = n_buffers


Key = tuple[str, tuple[int, ...]]

FEEDBACK_VALID, FEEDBACK_CACHE_HIT = 0x1, 0x2  # VkPipelineCreationFeedbackFlagBits


def build_workers() -> int:
    """Threads for parallel pipeline builds: the CPUs this process may use (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class Pipelines:
    """Per-device cache of shader modules, layouts and pipelines (thread-safe).

    `ensure(keys)` builds the pipelines a split needs that are not cached yet, all at
    once and in parallel worker threads, through the device's VkPipelineCache
    (`pipeline_cache.py`) when there is one. What the threads share: the VkDevice, the
    shader modules and pipeline layouts (created first, serially, and only read by
    vkCreateComputePipelines) and the VkPipelineCache (internally synchronised by the
    driver, see pipeline_cache.py). Each thread builds its own pipelines; the cache dict
    and the object counters are updated by the calling thread after all have returned.
    One `ensure` runs at a time (`_build_lock`), so two splits compiled at once never
    build the same pipeline twice.
    """

    def __init__(self, vk: Any, device: Any, live: Counter, *, vk_cache: Any = None, feedback: bool = False,
                 workers: int | None = None):
        self.vk = vk
        self.device = device
        self.live = live
        self.vk_cache = vk_cache  # a VkPipelineCache handle, or None
        self.feedback = feedback  # VK_EXT_pipeline_creation_feedback (or Vulkan 1.3) is available
        self.workers = workers if workers is not None else build_workers()
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._modules: dict[str, Any] = {}
        self._layouts: dict[int, tuple[Any, Any]] = {}  # n_buffers -> (set layout, pipeline layout)
        self._pipelines: dict[Key, Pipeline] = {}
        # built: pipelines created; cache_hits: of those, what the driver reported as found in
        # the VkPipelineCache (creation feedback; 0 where the driver does not say);
        # build_seconds: wall time spent in ensure() building them
        self.stats = {"built": 0, "cache_hits": 0, "build_seconds": 0.0, "builds": 0}

    def get(self, shader: str, spec: tuple[int, ...]) -> Pipeline:
        return self.ensure([(shader, spec)])[0]

    def ensure(self, keys: Sequence[Key]) -> list[Pipeline]:
        """The pipelines for `keys` (shader, specialization constants), building the missing
        ones in parallel. Returns them in the order of `keys`."""
        keys = [_norm(k) for k in keys]
        with self._lock:
            if all(k in self._pipelines for k in keys):
                return [self._pipelines[k] for k in keys]
        with self._build_lock:
            with self._lock:
                missing = list(dict.fromkeys(k for k in keys if k not in self._pipelines))
                for shader, _ in missing:  # serial and cheap; shared read-only by the builders
                    self._layout(SHADERS[shader])
                    self._module(shader)
            if missing:
                self._build(missing)
            with self._lock:
                return [self._pipelines[k] for k in keys]

    def _build(self, missing: list[Key]) -> None:
        start = time.perf_counter()
        results: list[tuple[Pipeline, bool] | BaseException] = []
        if len(missing) == 1 or self.workers <= 1:
            for key in missing:
                results.append(_try(self._create, key))
        else:
            with ThreadPoolExecutor(max_workers=min(self.workers, len(missing)),
                                    thread_name_prefix="flare-vk-pipeline") as pool:
                results = list(pool.map(lambda k: _try(self._create, k), missing))
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        made = [r for r in results if not isinstance(r, BaseException)]
        if failed is not None:  # nothing half-built stays: destroy what the others made
            for pipe, _ in made:
                self.vk.vkDestroyPipeline(self.device, pipe.handle, None)
            raise failed
        with self._lock:
            for key, (pipe, _) in zip(missing, made):
                self._pipelines[key] = pipe
                self.live["pipelines"] += 1
            self.stats["built"] += len(made)
            self.stats["cache_hits"] += sum(1 for _, hit in made if hit)
            self.stats["build_seconds"] += time.perf_counter() - start
            self.stats["builds"] += 1

    # -- creation ------------------------------------------------------------------
    def _module(self, shader: str) -> Any:
        module = self._modules.get(shader)
        if module is None:
            code = (SHADER_DIR / f"{shader}.spv").read_bytes()
            info = self.vk.VkShaderModuleCreateInfo(codeSize=len(code), pCode=code)
            module = self._modules[shader] = self.vk.vkCreateShaderModule(self.device, info, None)
            self.live["shader_modules"] += 1
        return module

    def _layout(self, n_buffers: int) -> tuple[Any, Any]:
        found = self._layouts.get(n_buffers)
        if found is not None:
            return found
        vk = self.vk
        bindings = [vk.VkDescriptorSetLayoutBinding(
            binding=i, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=1,
            stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT) for i in range(n_buffers + 1)]
        set_info = vk.VkDescriptorSetLayoutCreateInfo(bindingCount=len(bindings), pBindings=bindings)
        set_layout = vk.vkCreateDescriptorSetLayout(self.device, set_info, None)
        self.live["descriptor_set_layouts"] += 1
        push = vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=4)
        layout_info = vk.VkPipelineLayoutCreateInfo(setLayoutCount=1, pSetLayouts=[set_layout],
                                                    pushConstantRangeCount=1, pPushConstantRanges=[push])
        try:
            layout = vk.vkCreatePipelineLayout(self.device, layout_info, None)
        except BaseException:
            vk.vkDestroyDescriptorSetLayout(self.device, set_layout, None)
            self.live["descriptor_set_layouts"] -= 1
            raise
        self.live["pipeline_layouts"] += 1
        self._layouts[n_buffers] = (set_layout, layout)
        return set_layout, layout

    def _create(self, key: Key) -> tuple[Pipeline, bool]:
        """Build one pipeline (any thread); returns it and whether the driver found it in the cache."""
        vk = self.vk
        shader, spec = key
        n_buffers = SHADERS[shader]
        set_layout, layout = self._layouts[n_buffers]
        module = self._modules[shader]
        values = list(spec) + [0] * (N_SPEC - len(spec))
        data = vk.ffi.new("uint32_t[]", values)
        entries = [vk.VkSpecializationMapEntry(constantID=i, offset=4 * i, size=4) for i in range(len(values))]
        spec_info = vk.VkSpecializationInfo(mapEntryCount=len(values), pMapEntries=entries, dataSize=4 * len(values),
                                            pData=data)
        stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module, pName="main",
                                                   pSpecializationInfo=spec_info)
        fb = chain = None
        if self.feedback:
            fb = vk.ffi.new("VkPipelineCreationFeedback*")
            chain = vk.VkPipelineCreationFeedbackCreateInfo(pPipelineCreationFeedback=fb,
                                                            pipelineStageCreationFeedbackCount=0)
        info = vk.VkComputePipelineCreateInfo(pNext=chain, stage=stage, layout=layout)
        handle = vk.vkCreateComputePipelines(self.device, self.vk_cache, 1, [info], None)[0]
        hit = fb is not None and (fb.flags & FEEDBACK_VALID) != 0 and (fb.flags & FEEDBACK_CACHE_HIT) != 0
        return Pipeline(handle, layout, set_layout, n_buffers), hit

    # -- teardown ------------------------------------------------------------------
    def destroy(self) -> None:
        """Destroy pipelines, then layouts, then modules (reverse of creation); idempotent."""
        vk = self.vk
        with self._build_lock, self._lock:
            for pipe in self._pipelines.values():
                vk.vkDestroyPipeline(self.device, pipe.handle, None)
                self.live["pipelines"] -= 1
            self._pipelines.clear()
            for set_layout, layout in self._layouts.values():
                vk.vkDestroyPipelineLayout(self.device, layout, None)
                self.live["pipeline_layouts"] -= 1
                vk.vkDestroyDescriptorSetLayout(self.device, set_layout, None)
                self.live["descriptor_set_layouts"] -= 1
            self._layouts.clear()
            for module in self._modules.values():
                vk.vkDestroyShaderModule(self.device, module, None)
                self.live["shader_modules"] -= 1
            self._modules.clear()


def _norm(key: Key) -> Key:
    return key[0], tuple(int(v) for v in key[1])


def _try(fn: Callable[[Key], Any], key: Key) -> Any:
    try:
        return fn(key)
    except BaseException as exc:  # handed back to the caller, which destroys what others built
        return exc
