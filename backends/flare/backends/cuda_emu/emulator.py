"""Run the CUDA kernels on the host, to check them where there is no GPU.

The kernel sources of flare.backends.cuda compile as C++ with FLARE_EMULATE
defined (emulate.h, beside this file, maps each kernel to a host function that
runs the grid's blocks, each block's threads as cooperative fibers). `open_emulated_device()` is the real
`CudaDevice` over `host_driver.HostDriver`, a host stand-in for the driver
calls whose "device pointers" are host addresses: the very launch plans the
CUDA device captures run here, replayed from recorded graphs, and can be
compared with the NumPy references. What it cannot check: the real driver's
behaviour and the GPU's arithmetic.

Opt-in as a backend named `cuda-emu` with FLARE_CUDA_EMULATE=1 (testing only):
    FLARE_CUDA_EMULATE=1 pytest --pyargs flare.plugins.testing.conformance --backends=cuda-emu
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from flare.core.backend import Backend, ProbeResult
from flare.core.errors import BackendUnavailable, FlareError

from flare.backends.cuda import lowering
from flare.backends.cuda.compiler import KernelSource, cache_dir, kernel_sources

ENV_FLAG = "FLARE_CUDA_EMULATE"


class EmulationError(FlareError):
    """A kernel did something the emulator refuses (threads deadlocked at a barrier, a bad block)."""


def emulator_headers() -> dict[str, str]:
    """The host-only headers (emulate.h) the kernel sources include under FLARE_EMULATE."""
    root = resources.files(__package__)
    return {p.name: p.read_text() for p in root.iterdir() if p.name.endswith(".h")}


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
            fn.restype = ctypes.c_char_p  # NULL, or what went wrong (a deadlock at a barrier)
            self._fns[name] = fn
        return fn

    def run(self, kernel: str, args_address: int, grid, block) -> None:
        """Run every block of one launch; EmulationError when the kernel misbehaved."""
        error = self.function(kernel)(args_address, *grid, *block)
        if error:
            raise EmulationError(f"{kernel} grid={tuple(grid)} block={tuple(block)}: {error.decode()}")

    def launch(self, launch: lowering.Launch) -> None:
        self.run(launch.kernel, ctypes.addressof(launch.args), launch.grid, launch.block)


_LIBRARY: KernelLibrary | None = None
_LIBRARY_LOCK = threading.Lock()


def build_library(cache: Path | None = None, sources: Mapping[str, KernelSource] | None = None) -> KernelLibrary:
    """Compile (or reuse) the host build of every kernel file (or of `sources`, for tests
    of the emulator itself; those libraries are never the process-wide one)."""
    global _LIBRARY
    with _LIBRARY_LOCK:
        shared = cache is None and sources is None
        if _LIBRARY is not None and shared:
            return _LIBRARY
        cxx = host_compiler()
        if cxx is None:
            raise BackendUnavailable("no C++ compiler (c++, g++ or clang++) to build the CUDA kernel emulator")
        package = kernel_sources()
        sources = dict(sources) if sources is not None else package
        headers = {**next(iter(package.values())).headers, **emulator_headers()}
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
                # (no _FORTIFY_SOURCE: its longjmp check refuses the jumps between fiber stacks)
                cmd = [cxx, "-std=c++17", "-O2", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=0", "-shared", "-fPIC",
                       "-DFLARE_EMULATE", "-I", str(tmpdir),
                       *files, "-o", str(out)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"building the kernel emulator failed:\n{proc.stderr[-4000:]}")
                os.replace(out, lib_path)
        lib = KernelLibrary(lib_path)
        if shared:
            _LIBRARY = lib
        return lib


def open_emulated_device(capacity: int = 1 << 30, name: str = "cuda-emu:0"):
    """A `CudaDevice` over the host stand-in driver: the real device code, emulated kernels.

    Kernels are still compiled by NVRTC (the stand-in checks the CUBIN names
    each kernel), so this needs cuda-bindings and NVRTC, but no GPU or driver."""
    from flare.backends.cuda.device import CudaDevice
    from flare.backends.cuda.probe import GpuFacts

    from .host_driver import HostDriver

    driver = HostDriver(build_library(), capacity)
    return CudaDevice(GpuFacts(0, "host emulator", (9, 0), capacity), 90, "cubin", driver=driver,
                      name=name)


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
        try:
            from flare.backends.cuda.compiler import nvrtc_version

            version = nvrtc_version()  # kernels are still NVRTC-compiled and checked
        except Exception as exc:
            return ProbeResult(False, f"the emulator needs cuda-bindings and NVRTC: {exc}")
        return ProbeResult(True, f"CUDA kernels emulated on the host (built with {cxx}; NVRTC "
                                 f"{version[0]}.{version[1]})", ("cuda-emu:0",))

    @classmethod
    def open_devices(cls, config: Mapping[str, Any] | None = None) -> list[Any]:
        result = cls.probe()
        if not result.usable:
            raise BackendUnavailable(f"cuda-emu: {result.reason}")
        capacity = int((config or {}).get("memory_limit", 1 << 30))
        return [open_emulated_device(capacity)]

