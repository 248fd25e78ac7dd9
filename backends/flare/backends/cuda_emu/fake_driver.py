"""A stand-in `libcuda.so.1` (fake_libcuda.c) for running the REAL cuda-bindings without a GPU.

`HostDriver` replaces the bindings with Python and so cannot catch a wrong
argument type, a mis-unpacked result or a call the bindings resolve to another
ABI version. This C library is loaded by the bindings themselves (through
LD_LIBRARY_PATH, as the driver would be), which resolve every entry point with
cuGetProcAddress_v2 and call it with C arguments: the whole CUDA backend, probe
included, runs unmodified as backend `cuda`, with kernels executed by the host
emulator's library. It must be set up before the process first loads libcuda,
so tests run it in a subprocess: `environment()` gives the variables to set.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from flare.backends.cuda.compiler import cache_dir

from .emulator import build_library

SOURCE = "fake_libcuda.c"
LIVE_KEYS = ("memory", "pinned", "modules", "streams", "graphs", "execs")


def c_compiler() -> str | None:
    """$CC, else cc/gcc/clang."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(cache: Path | None = None) -> Path:
    """Build (or reuse) the stand-in; returns the folder holding libcuda.so.1."""
    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) to build the stand-in libcuda")
    text = resources.files(__package__).joinpath(SOURCE).read_text()
    digest = hashlib.sha256((cc + "\0" + text).encode()).hexdigest()[:24]
    folder = (cache or cache_dir()) / "fake-libcuda" / digest
    lib = folder / "libcuda.so.1"
    if not lib.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            src = Path(tmp) / SOURCE
            src.write_text(text)
            out = Path(tmp) / "libcuda.so.1"
            proc = subprocess.run([cc, "-std=c11", "-O1", "-Wall", "-Werror", "-shared", "-fPIC", str(src),
                                   "-o", str(out), "-ldl", "-lpthread"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building the stand-in libcuda failed:\n{proc.stderr[-4000:]}")
            os.replace(out, lib)
    link = folder / "libcuda.so"
    if not link.exists():
        try:
            link.symlink_to("libcuda.so.1")
        except FileExistsError:
            pass
    return folder


def environment(cache: Path | None = None, memory: int | None = None) -> dict[str, str]:
    """Variables that make a new process load the stand-in as its CUDA driver."""
    folder = build(cache)
    env = {
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in (str(folder), os.environ.get("LD_LIBRARY_PATH", "")) if p),
        "FLARE_FAKE_CUDA_KERNELS": str(build_library().path),
    }
    if memory is not None:
        env["FLARE_FAKE_CUDA_MEMORY"] = str(memory)
    return env


def live() -> dict[str, int]:
    """What the loaded stand-in holds (in a process that loaded it): for leak checks."""
    counts = (ctypes.c_int * 6)()
    ctypes.CDLL("libcuda.so.1").flare_fake_cuda_live(counts)
    return dict(zip(LIVE_KEYS, counts))
