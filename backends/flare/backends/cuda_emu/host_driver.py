"""A host stand-in for the part of `cuda.bindings.driver` that CudaDevice calls.

Same call names, arguments and `(CUresult, *values)` results as the bindings;
memory is host memory, kernels run in the kernel emulator, and stream capture
records launches into graphs that are replayed on `cuGraphLaunch`. With it,
`CudaDevice` and `CudaGraphSplit` (allocation, staging copies, module loading,
capture, exec update, teardown order, error paths) run and are tested on a
machine without a GPU. It is not a CUDA implementation: it checks the calling
discipline Flare relies on (a current context, nothing copied during capture,
handles destroyed once, exec graphs before their graphs), nothing more.

`faults` makes the next call of a name fail with a given CUresult, e.g.
`driver.faults["cuMemAlloc"] = "CUDA_ERROR_OUT_OF_MEMORY"`.
"""
from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from flare.backends.cuda.args import KArgs

_ELF = b"\x7fELF"


@dataclass
class _Node:
    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: KArgs


class HostDriver:
    """See the module docstring. `library` is an emulator.KernelLibrary."""

    def __init__(self, library: Any, total_memory: int = 1 << 30):
        from cuda.bindings import driver as real  # enums and CUdeviceptr need no libcuda

        self._real = real
        self.CUresult = real.CUresult
        self.CUdeviceptr = real.CUdeviceptr
        self.CUstream_flags = real.CUstream_flags
        self.CUstreamCaptureMode = real.CUstreamCaptureMode
        self.CUdevice_attribute = real.CUdevice_attribute
        self.library = library
        self.total_memory = total_memory
        self.log: list[str] = []
        self.faults: dict[str, str] = {}
        self._ids = itertools.count(1)
        self.memory: dict[int, np.ndarray] = {}
        self.pinned: dict[int, np.ndarray] = {}
        self.modules: dict[int, bytes] = {}
        self.streams: set[int] = set()
        self.graphs: dict[int, list[_Node]] = {}
        self.execs: dict[int, list[_Node]] = {}
        self.context_refs = 0
        self.initialized = False
        self._fills = 0
        self.current = None
        self._capturing: dict[int, list[_Node] | None] = {}

    # -- plumbing -----------------------------------------------------------------------
    def _status(self, name: str):
        return getattr(self.CUresult, name)

    def _enter(self, call: str, needs_context: bool = True):
        """Log the call; return a failure status (injected, or no context) or None."""
        self.log.append(call)
        fault = self.faults.pop(call, None)
        if fault is not None:
            return self._status(fault)
        if needs_context and (self.current is None or self.context_refs == 0):
            return self._status("CUDA_ERROR_INVALID_CONTEXT")
        return None

    def _ok(self, *values):
        return (self.CUresult.CUDA_SUCCESS, *values)

    def _bad(self, name: str, nvalues: int = 0):
        return (self._status(name), *([None] * nvalues))

    def _capturing_any(self) -> bool:
        return any(v is not None for v in self._capturing.values())

    # -- init, devices, contexts ------------------------------------------------------
    def cuInit(self, flags):
        err = self._enter("cuInit", False)
        if err:
            return (err,)
        self.initialized = True
        return self._ok()

    def cuDriverGetVersion(self):
        return self._ok(13000)

    def cuDeviceGet(self, ordinal):
        err = self._enter("cuDeviceGet", False)
        if err:
            return (err, None)
        if not self.initialized:  # as the real driver: every call but cuInit needs it first
            return self._bad("CUDA_ERROR_NOT_INITIALIZED", 1)
        return self._ok(int(ordinal))

    def cuDevicePrimaryCtxRetain(self, dev):
        err = self._enter("cuDevicePrimaryCtxRetain", False)
        if err:
            return (err, None)
        self.context_refs += 1
        return self._ok("primary-context")

    def cuDevicePrimaryCtxRelease(self, dev):
        err = self._enter("cuDevicePrimaryCtxRelease", False)
        if err:
            return (err,)
        if self.context_refs == 0:
            return self._bad("CUDA_ERROR_INVALID_CONTEXT")
        self.context_refs -= 1
        if self.context_refs == 0:  # the primary context goes, and everything in it
            self.current = None
            self.memory.clear()
        return self._ok()

    def cuCtxSetCurrent(self, ctx):
        err = self._enter("cuCtxSetCurrent", False)
        if err:
            return (err,)
        if self.context_refs == 0:
            return self._bad("CUDA_ERROR_INVALID_CONTEXT")
        self.current = ctx
        return self._ok()

    # -- memory ---------------------------------------------------------------------------
    def _used(self) -> int:
        return sum(a.nbytes for a in self.memory.values())

    def cuMemGetInfo(self):
        err = self._enter("cuMemGetInfo")
        return (err, None, None) if err else self._ok(self.total_memory - self._used(), self.total_memory)

    def cuMemAlloc(self, nbytes):
        err = self._enter("cuMemAlloc")
        if err:
            return (err, None)
        if self._used() + nbytes > self.total_memory:
            return self._bad("CUDA_ERROR_OUT_OF_MEMORY", 1)
        raw = np.empty(int(nbytes) + 256, np.uint8)
        start = (-raw.ctypes.data) % 256
        arr = raw[start: start + int(nbytes)]
        arr[:] = self._garbage(arr.nbytes)  # a real driver does not zero fresh memory
        self.memory[arr.ctypes.data] = arr
        return self._ok(self.CUdeviceptr(arr.ctypes.data))

    def _garbage(self, nbytes: int) -> np.ndarray:
        """Bytes that are never a plausible tensor by accident: NaN-ish f32/f16 patterns
        mixed with large integers, different on every allocation."""
        self._fills += 1
        pattern = np.frombuffer(np.array([0x7FC0DEAD, 0xFFFF7E57, 0x12345678 + self._fills], np.uint32).tobytes(),
                                np.uint8)
        return np.resize(pattern, nbytes)

    def cuMemFree(self, dptr):
        err = self._enter("cuMemFree")
        if err:
            return (err,)
        if self.memory.pop(int(dptr), None) is None:
            return self._bad("CUDA_ERROR_INVALID_VALUE")
        return self._ok()

    def cuMemAllocHost(self, nbytes):
        err = self._enter("cuMemAllocHost")
        if err:
            return (err, None)
        arr = self._garbage(int(nbytes))  # nor pinned host memory
        self.pinned[arr.ctypes.data] = arr
        return self._ok(arr.ctypes.data)

    def cuMemFreeHost(self, ptr):
        err = self._enter("cuMemFreeHost")
        if err:
            return (err,)
        return self._ok() if self.pinned.pop(int(ptr), None) is not None else self._bad("CUDA_ERROR_INVALID_VALUE")

    def _check_device_range(self, addr: int, nbytes: int) -> bool:
        return any(base <= addr and addr + nbytes <= base + a.nbytes for base, a in self.memory.items())

    def _check_pinned_range(self, addr: int, nbytes: int) -> bool:
        return any(base <= addr and addr + nbytes <= base + a.nbytes for base, a in self.pinned.items())

    def _copy(self, call: str, dst: int, src: int, nbytes: int, device_side: int, host_side: int):
        err = self._enter(call)
        if err:
            return (err,)
        if self._capturing_any():
            return self._bad("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        if not self._check_device_range(device_side, nbytes) or not self._check_pinned_range(host_side, nbytes):
            return self._bad("CUDA_ERROR_INVALID_VALUE")
        ctypes.memmove(dst, src, nbytes)
        return self._ok()

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        return self._copy("cuMemcpyHtoDAsync", int(dst), int(src), int(nbytes), int(dst), int(src))

    def cuMemcpyDtoHAsync(self, dst, src, nbytes, stream):
        return self._copy("cuMemcpyDtoHAsync", int(dst), int(src), int(nbytes), int(src), int(dst))

    def cuMemsetD8Async(self, dst, value, nbytes, stream):
        err = self._enter("cuMemsetD8Async")
        if err:
            return (err,)
        if not self._check_device_range(int(dst), int(nbytes)):
            return self._bad("CUDA_ERROR_INVALID_VALUE")
        ctypes.memset(int(dst), int(value), int(nbytes))
        return self._ok()

    # -- streams ----------------------------------------------------------------------------
    def cuStreamCreate(self, flags):
        err = self._enter("cuStreamCreate")
        if err:
            return (err, None)
        sid = next(self._ids)
        self.streams.add(sid)
        self._capturing[sid] = None
        return self._ok(sid)

    def cuStreamDestroy(self, stream):
        err = self._enter("cuStreamDestroy")
        if err:
            return (err,)
        if stream not in self.streams:
            return self._bad("CUDA_ERROR_INVALID_HANDLE")
        self.streams.discard(stream)
        self._capturing.pop(stream, None)
        return self._ok()

    def cuStreamSynchronize(self, stream):
        err = self._enter("cuStreamSynchronize")
        if err:
            return (err,)
        if self._capturing.get(stream) is not None:
            return self._bad("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        return self._ok()

    # -- modules and launches -------------------------------------------------------------
    def cuModuleLoadData(self, image):
        err = self._enter("cuModuleLoadData")
        if err:
            return (err, None)
        data = bytes(image)
        if not (data.startswith(_ELF) or b".target" in data):
            return self._bad("CUDA_ERROR_INVALID_IMAGE", 1)
        mid = next(self._ids)
        self.modules[mid] = data
        return self._ok(mid)

    def cuModuleUnload(self, module):
        err = self._enter("cuModuleUnload")
        if err:
            return (err,)
        return self._ok() if self.modules.pop(module, None) is not None else self._bad("CUDA_ERROR_INVALID_HANDLE")

    def cuModuleGetFunction(self, module, name):
        err = self._enter("cuModuleGetFunction")
        if err:
            return (err, None)
        if module not in self.modules or name not in self.modules[module]:
            return self._bad("CUDA_ERROR_NOT_FOUND", 1)
        return self._ok((module, name.decode()))

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        err = self._enter("cuLaunchKernel")
        if err:
            return (err,)
        module, name = fn
        if module not in self.modules:
            return self._bad("CUDA_ERROR_INVALID_HANDLE")
        args = KArgs()  # the driver copies the parameters at the call, so do we
        ctypes.memmove(ctypes.addressof(args), ctypes.c_void_p.from_address(int(params)).value, ctypes.sizeof(KArgs))
        node = _Node(name, (gx, gy, gz), (bx, by, bz), args)
        recording = self._capturing.get(stream)
        if recording is not None:
            recording.append(node)
        else:
            self._run([node])
        return self._ok()

    def _run(self, nodes: list[_Node]) -> None:
        for node in nodes:
            self.library.run(node.function, ctypes.addressof(node.args), node.grid, node.block)

    # -- graphs ------------------------------------------------------------------------------
    def cuStreamBeginCapture(self, stream, mode):
        err = self._enter("cuStreamBeginCapture")
        if err:
            return (err,)
        if self._capturing.get(stream) is not None:
            return self._bad("CUDA_ERROR_ILLEGAL_STATE")
        self._capturing[stream] = []
        return self._ok()

    def cuStreamEndCapture(self, stream):
        err = self._enter("cuStreamEndCapture")
        if err:
            return (err, None)
        nodes = self._capturing.get(stream)
        if nodes is None:
            return self._bad("CUDA_ERROR_ILLEGAL_STATE", 1)
        self._capturing[stream] = None
        gid = next(self._ids)
        self.graphs[gid] = nodes
        return self._ok(gid)

    def cuGraphInstantiate(self, graph, flags):
        err = self._enter("cuGraphInstantiate")
        if err:
            return (err, None)
        if graph not in self.graphs:
            return self._bad("CUDA_ERROR_INVALID_VALUE", 1)
        eid = next(self._ids)
        self.execs[eid] = list(self.graphs[graph])
        return self._ok(eid)

    def cuGraphExecUpdate(self, exec_, graph):
        err = self._enter("cuGraphExecUpdate")
        if err:
            return (err, None)
        if exec_ not in self.execs or graph not in self.graphs:
            return self._bad("CUDA_ERROR_INVALID_VALUE", 1)
        old, new = self.execs[exec_], self.graphs[graph]
        if [n.function for n in old] != [n.function for n in new]:
            return self._bad("CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", 1)
        self.execs[exec_] = list(new)
        return self._ok(None)

    def cuGraphLaunch(self, exec_, stream):
        err = self._enter("cuGraphLaunch")
        if err:
            return (err,)
        if exec_ not in self.execs:
            return self._bad("CUDA_ERROR_INVALID_HANDLE")
        self._run(self.execs[exec_])
        return self._ok()

    def cuGraphExecDestroy(self, exec_):
        err = self._enter("cuGraphExecDestroy")
        if err:
            return (err,)
        return self._ok() if self.execs.pop(exec_, None) is not None else self._bad("CUDA_ERROR_INVALID_HANDLE")

    def cuGraphDestroy(self, graph):
        err = self._enter("cuGraphDestroy")
        if err:
            return (err,)
        return self._ok() if self.graphs.pop(graph, None) is not None else self._bad("CUDA_ERROR_INVALID_HANDLE")

    def live(self) -> dict[str, int]:
        """What is still allocated on the stand-in (for leak assertions)."""
        return {"memory": len(self.memory), "pinned": len(self.pinned), "modules": len(self.modules),
                "streams": len(self.streams), "graphs": len(self.graphs), "execs": len(self.execs),
                "context_refs": self.context_refs}
