"""CUDA devices: driver-API memory, pinned staging copies, NVRTC modules, graph splits.

One `CudaDevice` per GPU, on the device's primary context (what every other
CUDA library in the process uses too), with one non-blocking stream for
copies, captures and replays. Memory comes from cuMemAlloc through the
ledger (`Device.alloc`); host<->device copies go through one pinned staging
buffer, which the DMA engine reads at full speed, in chunks.

Teardown order: splits destroy their executable graph then their graph;
`close()` releases live splits, then modules, the stream, the staging
buffer, and the primary context last — once every allocation is freed (a
buffer released after close still frees correctly).
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from flare.core.backend import Binding, BufferType, Device, MemoryInfo, SplitProgram
from flare.core.dtypes import to_numpy
from flare.core.errors import AllocationError, ReleasedError
from flare.core.graph import Tensor

from . import lowering
from .compiler import KernelCompiler, default_compiler, kernel_sources
from .driver import OUT_OF_MEMORY, CudaError, call, load, status_name
from .graph_host import GraphHandle
from .split import CudaGraphSplit
from .probe import GpuFacts

ALIGNMENT = 256                 # cuMemAlloc returns 256-byte aligned pointers
STAGING_CHUNK = 64 << 20        # largest pinned staging buffer; bigger copies go in chunks
STAGING_MIN = 1 << 20
LIVE_KEYS = ("graphs", "graph_execs", "allocations", "streams")
CACHE_KEYS = ("modules", "pinned")


class CudaDevice(Device):
    """One GPU. Not thread-safe for concurrent runs (one stream), safe to use from any thread."""

    backend = "cuda"

    def __init__(self, gpu: GpuFacts, arch: int, fmt: str, compiler: KernelCompiler | None = None,
                 driver: Any | None = None, name: str | None = None):
        """`driver` defaults to cuda.bindings.driver; the emulator passes a host stand-in
        with the same calls (flare.backends.cuda_emu.host_driver.HostDriver)."""
        super().__init__(name or f"cuda:{gpu.index}")
        self.gpu = gpu
        self.arch, self.fmt = arch, fmt
        self.compiler = compiler or default_compiler()
        self.driver = driver if driver is not None else load()
        self._lock = threading.RLock()
        self._counts = {"graphs": 0, "graph_execs": 0, "modules": 0, "streams": 0, "allocations": 0, "pinned": 0}
        self._modules: dict[str, Any] = {}
        self._functions: dict[tuple[str, str], Any] = {}
        self._splits: "weakref.WeakSet[CudaGraphSplit]" = weakref.WeakSet()
        self._staging_ptr: int | None = None
        self._staging_size = 0
        self._context_held = False
        self.module_formats: dict[str, str] = {}  # module -> "cubin"/"ptx" actually loaded
        d = self.driver
        # cuInit is idempotent and cheap; the probe called it in this process already, but
        # a device constructed directly (tests, tools) must not depend on that.
        call(d.cuInit(0), "cuInit")
        self._cu_device = call(d.cuDeviceGet(gpu.index), "cuDeviceGet")
        self.context = call(d.cuDevicePrimaryCtxRetain(self._cu_device), "cuDevicePrimaryCtxRetain")
        self._context_held = True
        self._make_current()
        self.stream = call(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        self._counts["streams"] += 1

    # -- bookkeeping ---------------------------------------------------------------
    def _make_current(self) -> None:
        call(self.driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def _check_open(self) -> None:
        if self.closed:
            raise ReleasedError(f"device {self.name} is closed")

    def count(self, kind: str, delta: int) -> None:
        with self._lock:
            self._counts[kind] += delta

    def live_objects(self) -> dict[str, int]:
        """Live graphs, graph execs, allocations and streams (for leak tests).

        These return to their baseline once splits and buffers are released.
        Loaded modules and the pinned staging buffer are caches that appear on
        first use and live until close() (see `cache_objects`), as the Vulkan
        backend's pipelines do, so a leak check needs no warm-up run."""
        with self._lock:
            return {k: self._counts[k] for k in LIVE_KEYS}

    def cache_objects(self) -> dict[str, int]:
        """Loaded modules and pinned staging buffers, kept until close()."""
        with self._lock:
            return {k: self._counts[k] for k in CACHE_KEYS}

    def forget(self, split: CudaGraphSplit) -> None:
        self._splits.discard(split)

    # -- memory ---------------------------------------------------------------------
    def buffer_type(self) -> BufferType:
        return BufferType("cuda", ALIGNMENT, self.gpu.total_memory)

    def memory(self) -> MemoryInfo:
        self._check_open()
        self._make_current()
        free, total = call(self.driver.cuMemGetInfo(), "cuMemGetInfo")
        return MemoryInfo(int(free), int(total))

    def _alloc_raw(self, nbytes: int) -> int:
        self._make_current()
        result = self.driver.cuMemAlloc(nbytes)
        status = result[0]
        if int(status) != 0:
            name = status_name(status)
            if name == OUT_OF_MEMORY:
                free = self.memory().free
                raise AllocationError(self.name, nbytes, free, name)
            raise CudaError("cuMemAlloc", name)
        self.count("allocations", +1)
        return int(result[1])

    def _free_raw(self, handle: Any) -> None:
        self._make_current()
        try:
            call(self.driver.cuMemFree(self.driver.CUdeviceptr(int(handle))), "cuMemFree")
        finally:
            self.count("allocations", -1)
            if self.closed:
                self._release_context_if_idle()

    # -- copies ---------------------------------------------------------------------
    def _staging(self, nbytes: int) -> tuple[int, np.ndarray]:
        """The pinned staging buffer (at least min(nbytes, STAGING_CHUNK) bytes) as bytes."""
        want = min(max(nbytes, STAGING_MIN), STAGING_CHUNK)
        if self._staging_ptr is None or self._staging_size < want:
            self._free_staging()
            ptr = call(self.driver.cuMemAllocHost(want), "cuMemAllocHost")
            self._staging_ptr, self._staging_size = int(ptr), want
            self.count("pinned", +1)
        raw = (ctypes.c_uint8 * self._staging_size).from_address(self._staging_ptr)
        return self._staging_ptr, np.frombuffer(raw, np.uint8)

    def _free_staging(self) -> None:
        if self._staging_ptr is not None:
            ptr, self._staging_ptr, self._staging_size = self._staging_ptr, None, 0
            self.count("pinned", -1)
            call(self.driver.cuMemFreeHost(ptr), "cuMemFreeHost")

    def _device_ptr(self, binding: Binding) -> int:
        return int(binding.buffer.handle) + binding.offset

    def _span_bytes(self, binding: Binding) -> int:
        if any(d == 0 for d in binding.shape):
            return 0
        span = 1 + sum((d - 1) * s for d, s in zip(binding.shape, binding.strides))
        return span * binding.itemsize

    def _h2d(self, dst: int, src: np.ndarray) -> None:
        """Copy the bytes of a C-contiguous array to device address `dst`, via pinned staging."""
        flat = src.reshape(-1).view(np.uint8)
        d = self.driver
        with self._lock:
            self._make_current()
            ptr, stage = self._staging(flat.nbytes)
            for start in range(0, flat.nbytes, self._staging_size):
                chunk = flat[start: start + self._staging_size]
                stage[: chunk.nbytes] = chunk
                call(d.cuMemcpyHtoDAsync(d.CUdeviceptr(dst + start), ptr, chunk.nbytes, self.stream),
                     "cuMemcpyHtoDAsync")
                call(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def _d2h(self, out: np.ndarray, src: int) -> None:
        """Copy device bytes at `src` into a C-contiguous array, via pinned staging."""
        flat = out.reshape(-1).view(np.uint8)
        d = self.driver
        with self._lock:
            self._make_current()
            ptr, stage = self._staging(flat.nbytes)
            for start in range(0, flat.nbytes, self._staging_size):
                n = min(self._staging_size, flat.nbytes - start)
                call(d.cuMemcpyDtoHAsync(ptr, d.CUdeviceptr(src + start), n, self.stream), "cuMemcpyDtoHAsync")
                call(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
                flat[start: start + n] = stage[:n]

    def write(self, binding: Binding, array: np.ndarray) -> None:
        """Host -> device. Strided targets are written by read-modify-write of their span."""
        self._check_open()
        dtype = to_numpy(binding.dtype)
        data = np.ascontiguousarray(np.asarray(array).astype(dtype, copy=False)).reshape(binding.shape)
        if data.size == 0:
            return
        if binding.is_contiguous:
            self._h2d(self._device_ptr(binding), data)
            return
        span = np.empty(self._span_bytes(binding), np.uint8)
        self._d2h(span, self._device_ptr(binding))
        np.lib.stride_tricks.as_strided(span.view(dtype), binding.shape,
                                        tuple(s * dtype.itemsize for s in binding.strides))[...] = data
        self._h2d(self._device_ptr(binding), span)

    def read_into(self, binding: Binding, out: np.ndarray) -> None:
        """Device -> host, into `out` (same shape and dtype)."""
        self._check_open()
        if out.size == 0:
            return
        dtype = to_numpy(binding.dtype)
        if binding.is_contiguous and out.flags.c_contiguous and out.dtype == dtype:
            self._d2h(out, self._device_ptr(binding))
            return
        span = np.empty(self._span_bytes(binding), np.uint8)
        self._d2h(span, self._device_ptr(binding))
        out[...] = np.lib.stride_tricks.as_strided(span.view(dtype), binding.shape,
                                                   tuple(s * dtype.itemsize for s in binding.strides))

    def fill_zero(self, binding: Binding) -> None:
        """Zero a tensor with cuMemset when it is contiguous."""
        self._check_open()
        if not binding.is_contiguous:
            return super().fill_zero(binding)
        if binding.nbytes == 0:
            return
        d = self.driver
        with self._lock:
            self._make_current()
            call(d.cuMemsetD8Async(d.CUdeviceptr(self._device_ptr(binding)), 0, binding.nbytes, self.stream),
                 "cuMemsetD8Async")
            call(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def synchronize(self) -> None:
        if not self.closed:
            self._make_current()
            call(self.driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    # -- kernels ----------------------------------------------------------------------
    def function(self, module: str, kernel: str) -> Any:
        """The CUfunction of `kernel`, compiling and loading its module on first use."""
        key = (module, kernel)
        with self._lock:
            fn = self._functions.get(key)
            if fn is None:
                self._make_current()
                mod = self._modules.get(module)
                if mod is None:
                    mod = self._load_module(module)
                fn = call(self.driver.cuModuleGetFunction(mod, kernel.encode()), f"cuModuleGetFunction({kernel})")
                self._functions[key] = fn
            return fn

    def _load_module(self, module: str) -> Any:
        """CUBIN for this GPU's arch; PTX (JIT by the driver) if the CUBIN is refused."""
        source = kernel_sources()[module]
        formats = [self.fmt] + [f for f in ("ptx",) if f != self.fmt]
        errors = []
        for fmt in formats:
            image = self.compiler.compile(source, self.arch, fmt)  # type: ignore[arg-type]
            result = self.driver.cuModuleLoadData(image.image)
            if int(result[0]) == 0:
                self._modules[module] = result[1]
                self.module_formats[module] = fmt
                self.count("modules", +1)
                return result[1]
            errors.append(f"{fmt} for sm_{self.arch}: {status_name(result[0])}")
        raise CudaError(f"cuModuleLoadData({module})", "; ".join(errors))

    def supports(self, node: Tensor) -> bool:
        return lowering.supported(node)

    def kernel_variants(self, op: str) -> tuple[str, ...]:
        """matmul and conv1d: "auto" (tile by shape), "t32"/"t64"/"t128" (output tile per block),
        "naive"; mul_mat_id: "mv" (matrix-vector kernel), "naive"."""
        return lowering.KERNEL_VARIANTS.get(op, ())

    def compile(self, program: SplitProgram) -> CudaGraphSplit:
        """Capture the split's launches into a CUDA graph (nothing runs yet)."""
        self._check_open()
        split = CudaGraphSplit(self.graph_handle, program)
        self._splits.add(split)
        return split

    def warm_up(self, modules: Iterable[str] | None = None) -> None:
        """Compile and load kernel modules ahead of the first compile() (all by default)."""
        for name in modules or kernel_sources():
            for kernel in kernel_sources()[name].kernels():
                self.function(name, kernel)

    # -- graphs: what a CudaGraphSplit may ask, through `graph_handle` -----------------
    @property
    def graph_handle(self) -> GraphHandle:
        """The narrow handle compiled splits get (graph_host.GraphHost) instead of the device."""
        return GraphHandle(self)

    def capture(self, record: Callable[[Any, Any], None]) -> Any:
        """Record what `record(driver, stream)` enqueues into a new CUDA graph.

        A failure mid-capture still ends the capture and destroys the partial
        graph, so the stream stays usable and nothing leaks."""
        d = self.driver
        with self._lock:
            self._make_current()
            call(d.cuStreamBeginCapture(self.stream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                 "cuStreamBeginCapture")
            try:
                record(d, self.stream)
            except BaseException:
                result = d.cuStreamEndCapture(self.stream)  # invalidated capture: usually no graph
                if int(result[0]) == 0 and len(result) > 1 and result[1] is not None:
                    d.cuGraphDestroy(result[1])
                raise
            graph = call(d.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
            self.count("graphs", +1)
            return graph

    def instantiate_graph(self, graph: Any) -> Any:
        with self._lock:
            self._make_current()
            exec_ = call(self.driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
            self.count("graph_execs", +1)
            return exec_

    def update_graph_exec(self, exec_: Any, graph: Any) -> bool:
        with self._lock:
            self._make_current()
            return int(self.driver.cuGraphExecUpdate(exec_, graph)[0]) == 0

    def launch_graph(self, exec_: Any) -> None:
        d = self.driver
        with self._lock:
            self._make_current()
            call(d.cuGraphLaunch(exec_, self.stream), "cuGraphLaunch")
            call(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def destroy_graph_exec(self, exec_: Any) -> None:
        self._make_current()
        self.count("graph_execs", -1)
        call(self.driver.cuGraphExecDestroy(exec_), "cuGraphExecDestroy")

    def destroy_graph(self, graph: Any) -> None:
        self._make_current()
        self.count("graphs", -1)
        call(self.driver.cuGraphDestroy(graph), "cuGraphDestroy")

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Release captures, modules, the stream and staging; the context once memory is freed.

        Idempotent. Buffers should be released first; any still live keep the
        context alive until they are."""
        if self.closed or not self._begin_close():  # refuse new uses, wait for executes in flight
            return
        d = self.driver
        self._make_current()
        errors: list[Exception] = []

        def attempt(fn: Callable[[], Any]) -> None:
            try:
                fn()
            except Exception as exc:  # keep tearing down; report the first failure after
                errors.append(exc)

        for split in list(self._splits):
            attempt(split.release)
        attempt(lambda: call(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize"))
        for name, mod in list(self._modules.items()):
            self._modules.pop(name)
            self.count("modules", -1)
            attempt(lambda mod=mod: call(d.cuModuleUnload(mod), "cuModuleUnload"))
        self._functions.clear()
        if self._counts["streams"]:
            self.count("streams", -1)
            attempt(lambda: call(d.cuStreamDestroy(self.stream), "cuStreamDestroy"))
        attempt(self._free_staging)
        self.closed = True
        self._release_context_if_idle()
        if errors:
            raise errors[0]

    def _release_context_if_idle(self) -> None:
        if self._context_held and self._counts["allocations"] == 0:
            self._context_held = False
            call(self.driver.cuDevicePrimaryCtxRelease(self._cu_device), "cuDevicePrimaryCtxRelease")

    def describe(self) -> dict[str, Any]:
        info = super().describe() if not self.closed else {"name": self.name}
        info.update({"gpu": self.gpu.name, "compute_capability": "%d.%d" % self.gpu.capability,
                     "target": f"{self.fmt} sm_{self.arch}"})
        return info

