"""Shader modules, descriptor set layouts and compute pipelines, cached for a device's life.

Every Flare shader has the same interface (see shaders/common.glsl): binding 0 is the
metadata buffer, bindings 1..n are whole data buffers, one push constant (the
dispatch's first metadata word), and specialization constants 0..4 (MODE and the four
dtypes), followed by the shader's own (workgroup and tile sizes, ids 5 and up). So a
descriptor set layout depends only on the shader's binding count, and a pipeline on
(shader, specialization constants). Pipelines are created on first
use, because compiling SPIR-V to machine code is the slow part (tens of ms on lavapipe),
and reused by every split compiled afterwards; `destroy()` (device close) frees them.
"""
from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

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


class PipelineCache:
    """Per-device cache of shader modules, layouts and pipelines (thread-safe)."""

    def __init__(self, vk: Any, device: Any, live: Counter):
        self.vk = vk
        self.device = device
        self.live = live
        self._lock = threading.Lock()
        self._modules: dict[str, Any] = {}
        self._layouts: dict[int, tuple[Any, Any]] = {}  # n_buffers -> (set layout, pipeline layout)
        self._pipelines: dict[tuple[str, tuple[int, ...]], Pipeline] = {}

    def get(self, shader: str, spec: tuple[int, ...]) -> Pipeline:
        key = (shader, tuple(int(s) for s in spec))
        with self._lock:
            pipe = self._pipelines.get(key)
            if pipe is None:
                pipe = self._pipelines[key] = self._create(shader, key[1])
            return pipe

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

    def _create(self, shader: str, spec: tuple[int, ...]) -> Pipeline:
        vk = self.vk
        n_buffers = SHADERS[shader]
        set_layout, layout = self._layout(n_buffers)
        module = self._module(shader)
        values = list(spec) + [0] * (N_SPEC - len(spec))
        data = vk.ffi.new("uint32_t[]", values)
        entries = [vk.VkSpecializationMapEntry(constantID=i, offset=4 * i, size=4) for i in range(len(values))]
        spec_info = vk.VkSpecializationInfo(mapEntryCount=len(values), pMapEntries=entries, dataSize=4 * len(values),
                                            pData=data)
        stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module, pName="main",
                                                   pSpecializationInfo=spec_info)
        info = vk.VkComputePipelineCreateInfo(stage=stage, layout=layout)
        handle = vk.vkCreateComputePipelines(self.device, None, 1, [info], None)[0]
        self.live["pipelines"] += 1
        return Pipeline(handle, layout, set_layout, n_buffers)

    # -- teardown ------------------------------------------------------------------
    def destroy(self) -> None:
        """Destroy pipelines, then layouts, then modules (reverse of creation); idempotent."""
        vk = self.vk
        with self._lock:
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
