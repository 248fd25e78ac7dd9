"""Run the CUDA kernels on the host, to check them where there is no GPU.

The kernel sources compile as C++ with FLARE_EMULATE defined (kernels/emulate.h
maps blockIdx/threadIdx to globals and each kernel to a function that runs the
grid's threads one after another). `EmulatedDevice` is a `flare.backend.Device`
whose "device pointers" are host addresses, so the very launch plans the CUDA
device captures (flare.backends.cuda.lowering) run here and can be compared
with the NumPy references. What it does not check: the driver API calls
(allocation, copies, module loading, CUDA graph capture and update).

Opt-in as a backend named `cuda-emu` with FLARE_CUDA_EMULATE=1 (testing only):
    FLARE_CUDA_EMULATE=1 pytest --pyargs flare.conformance --backends=cuda-emu
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from flare.backend import (Backend, Binding, BufferType, Device, MemoryInfo, PreparedSplit, ProbeResult,
                           SplitProgram, numpy_view)
from flare.errors import AllocationError, BackendUnavailable, ReleasedError
from flare.graph import Tensor

from . import lowering
from .compiler import cache_dir, emulator_headers, kernel_sources

ALIGNMENT = 256
ENV_FLAG = "FLARE_CUDA_EMULATE"


def host_compiler() -> str | None:
    """The C++ compiler to build the emulator with ($CXX, else c++/g++/clang++)."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class KernelLibrary:
    """The kernels compiled for the host as one shared library (cached by source hash)."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._fns: dict[str, Any] = {}

    def function(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(self._lib, name)
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6
            fn.restype = None
            self._fns[name] = fn
        return fn

    def launch(self, launch: lowering.Launch) -> None:
        """Run every thread of one launch, in order."""
        self.function(launch.kernel)(ctypes.addressof(launch.args), *launch.grid, *launch.block)


_LIBRARY: KernelLibrary | None = None
_LIBRARY_LOCK = threading.Lock()


def build_library(cache: Path | None = None) -> KernelLibrary:
    """Compile (or reuse) the host build of every kernel file."""
    global _LIBRARY
    with _LIBRARY_LOCK:
        if _LIBRARY is not None and cache is None:
            return _LIBRARY
        cxx = host_compiler()
        if cxx is None:
            raise BackendUnavailable("no C++ compiler (c++, g++ or clang++) to build the CUDA kernel emulator")
        sources = kernel_sources()
        headers = {**next(iter(sources.values())).headers, **emulator_headers()}
        h = hashlib.sha256(cxx.encode())
        for name in sorted(sources):
            h.update(sources[name].digest.encode())
        for name in sorted(headers):
            h.update(f"{name}\0{headers[name]}".encode())
        folder = (cache or cache_dir()) / "emulator"
        lib_path = folder / f"kernels-{h.hexdigest()[:24]}.so"
        if not lib_path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                tmpdir = Path(tmp)
                for name, text in headers.items():
                    (tmpdir / name).write_text(text)
                files = []
                for name, src in sources.items():
                    (tmpdir / f"{name}.cpp").write_text(src.text)
                    files.append(str(tmpdir / f"{name}.cpp"))
                out = tmpdir / "kernels.so"
                cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-DFLARE_EMULATE", "-I", str(tmpdir),
                       *files, "-o", str(out)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"building the kernel emulator failed:\n{proc.stderr[-4000:]}")
                os.replace(out, lib_path)
        lib = KernelLibrary(lib_path)
        if cache is None:
            _LIBRARY = lib
        return lib


class EmulatedSplit(PreparedSplit):
    """A split's launch plan, run by the host build of the kernels."""

    def __init__(self, device: "EmulatedDevice", plan: list[lowering.Launch]):
        self.device = device
        self.plan = plan
        self.released = False

    def run(self) -> None:
        if self.released:
            raise ReleasedError("emulated CUDA split was released")
        for launch in self.plan:
            self.device.library.launch(launch)

    def rebind(self, program: SplitProgram) -> bool:
        """Re-lower against new bindings (what a CUDA graph update does)."""
        self.plan = lowering.lower_all(program.nodes, program.binding)
        return True

    def release(self) -> None:
        self.released = True
        self.plan = []


class EmulatedDevice(Device):
    """Host memory addressed by raw pointers, kernels run by the emulator."""

    backend = "cuda-emu"

    def __init__(self, name: str = "cuda-emu:0", capacity: int = 1 << 30, priority: int = -10):
        super().__init__(name, priority)
        self.capacity = capacity
        self._arrays: dict[int, np.ndarray] = {}
        self.library = build_library()

    def buffer_type(self) -> BufferType:
        return BufferType("cuda-emu", ALIGNMENT, self.capacity)

    def memory(self) -> MemoryInfo:
        used = sum(a.nbytes for a in self._arrays.values())
        return MemoryInfo(max(0, self.capacity - used), self.capacity)

    def _alloc_raw(self, nbytes: int) -> int:
        if nbytes > self.memory().free:
            raise AllocationError(self.name, nbytes, self.memory().free, "emulated device memory exhausted")
        raw = np.zeros(nbytes + ALIGNMENT, np.uint8)
        start = (-raw.ctypes.data) % ALIGNMENT
        view = raw[start: start + nbytes]
        self._arrays[view.ctypes.data] = view
        return view.ctypes.data

    def _free_raw(self, handle: Any) -> None:
        self._arrays.pop(int(handle), None)

    def _view(self, binding: Binding) -> np.ndarray:
        return numpy_view(self._arrays[int(binding.buffer.handle)], binding)

    def write(self, binding: Binding, array: np.ndarray) -> None:
        np.copyto(self._view(binding), array, casting="same_kind")

    def read_into(self, binding: Binding, out: np.ndarray) -> None:
        np.copyto(out, self._view(binding))

    def supports(self, node: Tensor) -> bool:
        return lowering.supported(node)

    def compile(self, program: SplitProgram) -> EmulatedSplit:
        return EmulatedSplit(self, lowering.lower_all(program.nodes, program.binding))

    def live_objects(self) -> dict[str, int]:
        return {"allocations": len(self._arrays)}


class EmulatedBackend(Backend):
    """The `cuda-emu` backend (registered only when FLARE_CUDA_EMULATE=1)."""

    name = "cuda-emu"

    @classmethod
    def probe(cls) -> ProbeResult:
        if not os.environ.get(ENV_FLAG):
            return ProbeResult(False, f"testing aid: set {ENV_FLAG}=1 to run the CUDA kernels on the host")
        cxx = host_compiler()
        if cxx is None:
            return ProbeResult(False, "no C++ compiler (c++, g++ or clang++) to build the CUDA kernel emulator")
        return ProbeResult(True, f"CUDA kernels emulated on the host (built with {cxx})", ("cuda-emu:0",))

    @classmethod
    def open_devices(cls, config: Mapping[str, Any] | None = None) -> list[EmulatedDevice]:
        result = cls.probe()
        if not result.usable:
            raise BackendUnavailable(f"cuda-emu: {result.reason}")
        capacity = int((config or {}).get("memory_limit", 1 << 30))
        return [EmulatedDevice("cuda-emu:0", capacity)]

