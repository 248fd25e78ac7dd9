"""CPU devices: arenas are NumPy byte arrays; kernels write into views of them.

Several *logical* CPU devices (`cpu:0`, `cpu:1`, ...) can be opened, each with
its own ledger name and optional memory limit, so multi-backend scheduling,
copies and real out-of-memory are testable on a machine with no GPU.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

import numpy as np

from flare.core.backend import Binding, Buffer, BufferType, Device, MemoryInfo, PreparedSplit, SplitProgram, numpy_view
from flare.core.dtypes import is_quant
from flare.core.errors import AllocationError
from flare.core.graph import Tensor
from flare.core.host_calls import host_node_step
from flare.core.ledger import LEDGER
from flare.core.ops import OPS
from flare.core.ops.fused import FUSED_OPS

from . import native as native_mod
from .kernels import KERNELS, VARIANTS
from . import kernels_indexing, kernels_math, kernels_spatial  # noqa: F401  (register the kernels of the ONNX-driven ops)
from .native.compile import compile_native
from .native.packing import PackCache
from .native.threads import ThreadPool, physical_cores
from .split import CpuSplit
from .zeroing import zero_fill

ALIGNMENT = 64
# Fused ops the C executor takes. Not `attention`: a per-head C kernel measured 1.2-2.7x slower
# than the unfused matmul / softmax / matmul commands (MiniLM b32 heads, moe decode), so the
# chain stays unfused on the CPU.
NATIVE_FUSED = ("linear", "norm_affine", "leaky_relu", "conv_add")
def _physical_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


HUGE_PAGE = 2 << 20  # x86-64 transparent huge page
PACK_SLAB = 2 * HUGE_PAGE  # slabs of the packed copies under 2 MiB (_from_pack_slab)


def _huge_page_backed(nbytes: int, device: str, memory: Callable[[], MemoryInfo]) -> np.ndarray:
    """nbytes from an anonymous mapping whose whole 2 MiB pages are advised as transparent huge pages
    (MADV_HUGEPAGE; the system's THP mode is usually `madvise`): the packed weights stream through
    the kernels once per call (MiniLM batch 1: 42 MiB, more than the L3) and the CPU's prefetchers
    stop at every 4 KiB page boundary. MiniLM batch 1, one thread, native part, with its packed
    1536x384 layers (2.4 MB each, 2 MiB of each in a huge page): best 2502-2696 us against
    3113-3216 (three alternated runs of 200 on the loaded shared machine). The buffer
    starts on a 2 MiB boundary and only its whole 2 MiB pages are advised, so no page is faulted in
    beyond the buffer (the mapping's slack is never touched); where madvise is refused, or the
    system has THP off, the memory is the same anonymous memory in small pages."""
    import mmap

    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        raise AllocationError(device, nbytes, memory().free, "host out of memory") from None
    raw = np.frombuffer(region, np.uint8)
    start = (-raw.ctypes.data) % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    advise = getattr(region, "madvise", None)
    if advise is not None and hasattr(mmap, "MADV_HUGEPAGE") and whole:
        try:
            advise(mmap.MADV_HUGEPAGE, start, whole)
        except OSError:
            pass
    return raw[start: start + nbytes]


class CpuDevice(Device):
    backend = "cpu"

    def __init__(self, name: str, memory_limit: int | None = None, max_buffer: int | None = None,
                 native: bool = True, threads: int | None = None):
        super().__init__(name)
        self.memory_limit = memory_limit
        self.max_buffer = max_buffer
        self.native = native_mod.load() if native else None
        self.native_reason = native_mod.REASON if native else "disabled by the device config (native = false)"
        # threads of the C kernels (None: one per physical core); the pool is this device's alone
        self.threads = threads if threads is not None else physical_cores()
        self.pool = ThreadPool(self.native, self.threads) if self.native is not None else None
        self._views: dict[int, dict[tuple, np.ndarray]] = {}  # id(buffer handle) -> binding key -> view
        self._slab: tuple[np.ndarray | None, int] = (None, 0)  # packed copies under 2 MiB: slab, bytes cut
        self._slab_lock = threading.Lock()
        self.packs = PackCache(self._alloc_packed)

    def buffer_type(self) -> BufferType:
        limit = self.max_buffer or self.memory_limit or (1 << 62)
        return BufferType("cpu", ALIGNMENT, limit)

    def memory(self) -> MemoryInfo:
        if self.memory_limit is not None:
            return MemoryInfo(max(0, self.memory_limit - LEDGER.live_bytes(self.name)), self.memory_limit)
        avail = _physical_available()
        return MemoryInfo(avail, avail + LEDGER.live_bytes(self.name))

    def _from_pack_slab(self, nbytes: int) -> np.ndarray:
        """A packed copy under 2 MiB (MiniLM's 384x384 layers: 590 KB) as a slice of a shared slab of
        huge pages (PACK_SLAB bytes), cut in order: the slab lives while any of its slices does (they
        are views of it), and a freed slice's bytes are not reused, which costs little since a model's
        packed copies are made and freed together."""
        size = -(-nbytes // ALIGNMENT) * ALIGNMENT
        with self._slab_lock:
            slab, used = self._slab
            if slab is None or used + size > slab.nbytes:
                slab, used = _huge_page_backed(PACK_SLAB, self.name, self.memory), 0
            self._slab = (slab, used + size)
        return slab[used: used + nbytes]

    def _alloc_packed(self, nbytes: int, tag: str) -> Buffer:
        """A packed weight's buffer: written whole at once and then streamed by every product, so
        it may take huge pages (`_huge_page_backed`) with no memory beyond its own bytes; other
        buffers (arenas, KV caches) may be touched in part, where a huge page would make 2 MiB
        resident for a few bytes, so they keep small pages."""
        return self._alloc_through_ledger(nbytes, tag, self._packed_raw)

    def _packed_raw(self, nbytes: int) -> np.ndarray:
        if nbytes >= HUGE_PAGE:
            return _huge_page_backed(nbytes, self.name, self.memory)
        return self._from_pack_slab(nbytes)

    def _alloc_raw(self, nbytes: int) -> np.ndarray:
        try:
            # over-allocate by the alignment so the first byte can be aligned
            raw = np.empty(nbytes + ALIGNMENT, np.uint8)
        except MemoryError:
            raise AllocationError(self.name, nbytes, self.memory().free, "host out of memory") from None
        start = (-raw.ctypes.data) % ALIGNMENT
        return raw[start: start + nbytes]

    def adopt(self, array: np.ndarray, tag: str = "") -> Buffer | None:
        """The kernels read weights through pointers and take unaligned rows (the quantized ones
        load unaligned; float matmul weights are packed into buffers of their own), so a
        contiguous array is used as it is: a GGUF file's tensors (32-byte aligned) stay in the
        page cache's pages, resident only as they are read, as llama.cpp's are."""
        if not array.flags.c_contiguous or array.nbytes == 0 or array.ctypes.data % 16:
            return None
        LEDGER.admit(self.name, array.nbytes, self.memory().free)
        return Buffer(self, array.nbytes, array.reshape(-1).view(np.uint8), tag)

    def _free_raw(self, handle: Any) -> None:
        self._views.pop(id(handle), None)  # the array itself is dropped with the Buffer's reference

    def host_view(self, binding: Binding) -> np.ndarray:
        """A cached strided view: execute writes inputs and reads outputs through the same
        bindings every call, and building an as_strided view costs more than the copy."""
        handle = binding.buffer.handle
        views = self._views.get(id(handle))
        if views is None:
            views = self._views.setdefault(id(handle), {})
        key = (binding.offset, binding.shape, binding.strides, binding.dtype)
        view = views.get(key)
        if view is None:
            view = views[key] = numpy_view(handle, binding)
        return view

    def write(self, binding: Binding, array: np.ndarray) -> None:
        np.copyto(self.host_view(binding), array, casting="same_kind")

    def read_into(self, binding: Binding, out: np.ndarray) -> None:
        np.copyto(out, self.host_view(binding))

    def fill_zero(self, binding: Binding) -> None:
        zero_fill(self.host_view(binding))   # large buffers: pages given back, not written (zeroing.py)

    def supports(self, node: Tensor) -> bool:
        if node.op in FUSED_OPS:  # only the native executor has fused kernels worth fusing for
            return (self.native is not None and node.op in NATIVE_FUSED and all(s.dtype == "f32" for s in node.srcs)
                    and (node.op != "conv_add" or kernels_spatial.conv_add_native(node)))
        return node.op in KERNELS

    def kernel_variants(self, op: str) -> tuple[str, ...]:
        return tuple(VARIANTS.get(op, ()))

    def expert_stage_step(self, state: Any, sources: Sequence[np.ndarray],
                          targets: Sequence[Callable[[], np.ndarray]], age_every: int) -> Any:
        """`ExpertStager`'s staging step in C for one layer's caches in this device's memory
        (native/staging.py), or None without the native executor (the stager then stages in
        Python). The step runs on the staging thread inside the execute, not on the pool."""
        if self.native is None:
            return None
        from .native.staging import StageStep
        return StageStep(self.native, state, sources, targets, age_every)

    def expert_stage_command(self, sources: Sequence[np.ndarray], targets: Sequence[Callable[[], np.ndarray]],
                             acc: np.ndarray, age_every: int, on_error: Callable[[int], BaseException],
                             ids: np.ndarray, rows: np.ndarray | None, out: np.ndarray,
                             scratch_row: int) -> tuple[dict, Any] | None:
        """Expert staging's step as a command of a native split (`stage_experts` in kernels.c):
        (the command, its `WalkBlock`, which the stager binds to its layer's arrays), or None
        (no native executor, or views the command does not take: the split calls the callback)."""
        if self.native is None:
            return None
        from .native.staging import WalkBlock, stage_command
        block = WalkBlock(sources, [t() for t in targets], acc, age_every, on_error)
        c = stage_command(block, ids, rows, out, scratch_row)
        return None if c is None else (c, block)

    @property
    def stages_in_walk(self) -> bool:
        """Whether a split can run expert staging as a command of its own (`stage_experts` in
        kernels.c: the native executor), so the `stage_experts` host node needs no host split."""
        return self.native is not None

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["executor"] = "native" if self.native is not None else f"numpy ({self.native_reason})"
        if self.native is not None:
            info["blas"] = self.native.blas.path
            info["threads"] = self.threads
            info["blas_threads"] = self.native.blas.threads()
            # constant weights copied into the packed-panel layout (native/packing.py), shared by all plans
            info["prepacked_bytes"] = self.packs.nbytes()
        return info

    def close(self) -> None:
        """Wait for the executes in flight (`_begin_close`), then stop the worker threads: a
        command list still running on the pool would otherwise lose it under its feet."""
        if self.closed or not self._begin_close():
            return
        self.closed = True
        if self.pool is not None:
            self.pool.close()

    def compile(self, program: SplitProgram) -> PreparedSplit:
        """The native command list when the C executor is loaded, else NumPy closures."""
        if self.native is not None:
            return compile_native(self, self.native, program)
        return self.compile_numpy(program)

    def numpy_step(self, program: SplitProgram, node: Tensor, owned: list[Any]) -> Callable[[], None]:
        """Bind a node's NumPy kernel (or the tuned variant `program.tuning[op]`) to arena views."""
        kern = KERNELS[node.op]
        out = self.host_view(program.binding(node))
        srcs = [self.host_view(program.binding(s)) for s in node.srcs]
        variant = program.tuning.get(node.op)
        if any(is_quant(s.dtype) for s in node.srcs):
            variant = None     # tuned variants are float layouts; block weights keep their own kernel
        if variant is not None and variant in VARIANTS.get(node.op, {}):
            kern = VARIANTS[node.op][variant]
            if variant == "packed" and srcs[1].dtype.names:  # block-quantized: nothing to pack
                kern = KERNELS[node.op]
            elif variant == "packed":
                srcs = self._pack(node, srcs, owned)
        return _bind(kern, out, srcs, node.params)

    def compile_numpy(self, program: SplitProgram) -> CpuSplit:
        steps, owned = [], []
        try:
            for node in program.nodes:
                if node.op == "host":          # left in the split (`runs_in_walk`): the callback
                    steps.append(host_node_step(node, program.bindings, self, program.host_calls))
                elif OPS[node.op].view is None:  # views alias their source: nothing to run
                    steps.append(self.numpy_step(program, node, owned))
        except BaseException:
            for buf in owned:
                buf.release()
            raise
        return CpuSplit(steps, owned)

    def _pack(self, node: Tensor, srcs: list[np.ndarray], owned: list[Any]) -> list[np.ndarray]:
        """`packed` matmul: a constant right operand stored transposed, once, in a buffer of the split."""
        from flare.core.graph import WEIGHT
        if not node.params.get("transpose_b") or node.srcs[1].storage.role != WEIGHT:
            return [srcs[0], np.swapaxes(srcs[1], -1, -2) if node.params.get("transpose_b") else srcs[1]]
        packed_t = np.ascontiguousarray(np.swapaxes(srcs[1], -1, -2), np.float32)
        buf = self.alloc(packed_t.nbytes, tag=f"cpu:packed:{node.srcs[1].name}")
        owned.append(buf)
        view = buf.handle[: packed_t.nbytes].view(np.float32).reshape(packed_t.shape)
        view[...] = packed_t
        return [srcs[0], view]


def _bind(kern, out, srcs, params) -> Callable[[], None]:
    return lambda: kern(out, srcs, params)


