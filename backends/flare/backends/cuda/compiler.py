"""NVRTC compilation of Flare's CUDA kernels, with an on-disk cache. Needs no GPU.

Kernels are CUDA C files shipped as package data (`kernels/*.cu`). They are
compiled at run time for the device's own architecture, because a CUBIN made
for `sm_XY` is loaded by the driver as is, whereas PTX newer than the driver
is refused (CUDA_ERROR_UNSUPPORTED_PTX_VERSION). PTX is the fallback for a GPU
newer than every architecture this NVRTC knows (the driver JIT-compiles it).

Compiling takes a noticeable fraction of a second per file, so images are
cached on disk under `cache_dir()` keyed by everything that changes the
output: source and header text, target, format, options and NVRTC version.
Nothing here touches the driver, so it runs on a machine with no GPU at all.
"""
from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterable, Literal, Mapping

from flare.core.cache import cache_root, write_atomic
from flare.core.errors import FlareError

Format = Literal["cubin", "ptx"]
FORMATS: tuple[Format, ...] = ("cubin", "ptx")
# Bump when the way images are produced changes without the inputs changing.
CACHE_SCHEMA = 1
DEFAULT_OPTIONS: tuple[str, ...] = ("--std=c++17",)
KERNEL_PACKAGE = "flare.backends.cuda.kernels"


class CompileError(FlareError):
    """NVRTC rejected a kernel file; the message carries NVRTC's log."""


class CompilerUnavailable(FlareError):
    """NVRTC (the bindings or its shared library) cannot be loaded here."""


@dataclass(frozen=True)
class KernelSource:
    """One compilation unit: a `.cu` file plus the headers it may include."""

    name: str
    text: str
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """Hash of the source and every header (name and text), stable across runs."""
        h = hashlib.sha256()
        for part in (self.name, self.text, *(f"{k}\0{v}" for k, v in sorted(self.headers.items()))):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def kernels(self) -> tuple[str, ...]:
        """Names of the kernels this file defines: its `FLARE_KERNEL(name)` lines, and the
        names listed on `// FLARE_KERNELS: a b c` lines (kernels a macro instantiates)."""
        names = re.findall(r"^FLARE_KERNEL\((\w+)\)", self.text, flags=re.M)
        for line in re.findall(r"^// FLARE_KERNELS:(.*)$", self.text, flags=re.M):
            names += line.split()
        return tuple(names)


@dataclass(frozen=True)
class CompiledImage:
    """A compiled module image (CUBIN bytes or NUL-terminated PTX text)."""

    source: str
    arch: int
    fmt: Format
    image: bytes
    key: str
    from_cache: bool = False
    log: str = ""

    @property
    def ptx_target(self) -> str | None:
        """The `.target` line of a PTX image (e.g. `sm_90`), None for CUBIN."""
        if self.fmt != "ptx":
            return None
        m = re.search(rb"^\s*\.target\s+(\w+)", self.image, flags=re.M)
        return m.group(1).decode() if m else None


# ---- the kernel files ------------------------------------------------------------

def kernel_sources() -> dict[str, KernelSource]:
    """Every kernel file of the package, by file stem (`elementwise`, `matmul`, ...).

    Each carries the `.cuh` headers (NVRTC resolves `#include "common.cuh"`
    from these, so no include path has to exist on disk)."""
    root = resources.files(KERNEL_PACKAGE)
    headers = {p.name: p.read_text() for p in root.iterdir() if p.name.endswith(".cuh")}
    return {
        p.name[:-3]: KernelSource(p.name[:-3], p.read_text(), headers)
        for p in sorted(root.iterdir(), key=lambda p: p.name)
        if p.name.endswith(".cu")
    }


# ---- NVRTC ------------------------------------------------------------------------

def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise CompilerUnavailable(f"cuda-bindings is not installed ({exc}): pip install flare-runtime[cuda]") from None
    return nvrtc


def _out_buffer(size: int) -> bytearray:
    """A fresh, writable buffer for NVRTC to fill (never a possibly shared bytes object)."""
    return bytearray(max(int(size), 1))


def _call(result: tuple, what: str):
    """Unpack an NVRTC binding result `(status, *values)`, raising on failure."""
    status, *values = result
    if int(status) != 0:
        raise CompileError(f"{what} failed: {getattr(status, 'name', status)}")
    return values[0] if len(values) == 1 else tuple(values)


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library; CompilerUnavailable if it cannot load."""
    nvrtc = _nvrtc()
    try:
        major, minor = _call(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except CompileError:
        raise
    except Exception as exc:  # the shared library is missing: pathfinder raises
        raise CompilerUnavailable(f"NVRTC library not found ({type(exc).__name__}: {exc}): "
                                  "pip install nvidia-cuda-nvrtc") from None
    return int(major), int(minor)


def supported_archs() -> tuple[int, ...]:
    """Architectures this NVRTC can emit SASS for, e.g. (75, 80, 86, ..., 120)."""
    nvrtc = _nvrtc()
    try:
        archs = _call(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    except CompileError:
        raise
    except Exception as exc:
        raise CompilerUnavailable(f"NVRTC library not found ({type(exc).__name__}: {exc})") from None
    return tuple(int(a) for a in archs)


def pick_target(capability: tuple[int, int], archs: Iterable[int]) -> tuple[int, Format] | None:
    """What to compile for a GPU of compute `capability`, given NVRTC's `archs`.

    CUBIN for the device's own architecture when NVRTC knows it; PTX for the
    newest known architecture when the GPU is newer than all of them (the
    driver JIT-compiles it); None when the GPU is older than all of them.
    """
    arch = capability[0] * 10 + capability[1]
    archs = sorted(archs)
    if arch in archs:
        return arch, "cubin"
    older = [a for a in archs if a <= arch]
    if older:
        return older[-1], "ptx"
    return None


def _compile_with_nvrtc(source: KernelSource, arch: int, fmt: Format, options: tuple[str, ...]) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    names = sorted(source.headers)
    prog = _call(nvrtc.nvrtcCreateProgram(source.text.encode(), f"{source.name}.cu".encode(), len(names),
                                          [source.headers[n].encode() for n in names],
                                          [n.encode() for n in names]), "nvrtcCreateProgram")
    try:
        target = f"sm_{arch}" if fmt == "cubin" else f"compute_{arch}"
        opts = [f"--gpu-architecture={target}".encode(), *(o.encode() for o in options)]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _call(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        # NVRTC writes into these buffers: they must be fresh mutable memory. (`b" " * 1`
        # is CPython's shared one-byte bytes object; writing the log's NUL into it once
        # turned every b" " in the process into b"\0".)
        log = _out_buffer(size)
        _call(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log_text = log.rstrip(b"\0").decode(errors="replace").strip()
        if int(status) != 0:
            raise CompileError(f"NVRTC could not compile {source.name}.cu for {target} "
                               f"({getattr(status, 'name', status)}):\n{log_text}")
        if fmt == "cubin":
            size = _call(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            image = _out_buffer(size)
            _call(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
        else:
            size = _call(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            image = _out_buffer(size)
            _call(nvrtc.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
        image = bytes(image)
        if not image.strip(b"\0 "):
            raise CompileError(f"NVRTC produced an empty {fmt} for {source.name}.cu ({target})")
        return image, log_text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# ---- the cache --------------------------------------------------------------------

def cache_dir() -> Path:
    """Where compiled images live: `$FLARE_CACHE_DIR/cuda`, else `~/.cache/flare/cuda`.

    The same root as `flare.core.cache.cache_dir("cuda")`, but not created here: a
    cache that cannot be created only costs recompiling."""
    return cache_root() / "cuda"


def cache_key(source: KernelSource, arch: int, fmt: Format, version: tuple[int, int],
              options: Iterable[str] = DEFAULT_OPTIONS) -> str:
    """Everything that changes the compiled image, hashed."""
    h = hashlib.sha256()
    for part in (f"schema={CACHE_SCHEMA}", source.digest, f"arch={arch}", f"fmt={fmt}",
                 f"nvrtc={version[0]}.{version[1]}", *options):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class KernelCompiler:
    """Compiles kernel files through a memory and disk cache (thread-safe).

    A cache that cannot be written (read-only home, full disk) only costs
    recompilation; it is never an error.
    """

    def __init__(self, cache: Path | str | None = None, options: Iterable[str] = DEFAULT_OPTIONS,
                 use_disk: bool = True):
        self.cache = Path(cache) if cache is not None else cache_dir()
        self.options = tuple(options)
        self.use_disk = use_disk
        self._memory: dict[str, CompiledImage] = {}
        self._lock = threading.Lock()
        self._version: tuple[int, int] | None = None
        self.compiled = 0  # NVRTC invocations made by this compiler (tests read it)

    @property
    def version(self) -> tuple[int, int]:
        if self._version is None:
            self._version = nvrtc_version()
        return self._version

    def key(self, source: KernelSource, arch: int, fmt: Format) -> str:
        return cache_key(source, arch, fmt, self.version, self.options)

    def path(self, source: KernelSource, arch: int, fmt: Format) -> Path:
        """The cache file of one image (whether or not it exists yet)."""
        key = self.key(source, arch, fmt)
        return self.cache / f"{source.name}-sm{arch}-{key[:24]}.{fmt}"

    def compile(self, source: KernelSource, arch: int, fmt: Format = "cubin") -> CompiledImage:
        """The image of `source` for `arch` in `fmt`, from cache when possible."""
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r}: expected one of {FORMATS}")
        key = self.key(source, arch, fmt)
        with self._lock:
            hit = self._memory.get(key)
            if hit is not None:
                return hit
            path = self.path(source, arch, fmt)
            image = self._read(path)
            if image is not None:
                result = CompiledImage(source.name, arch, fmt, image, key, from_cache=True)
            else:
                image, log = _compile_with_nvrtc(source, arch, fmt, self.options)
                self.compiled += 1
                self._write(path, image)
                result = CompiledImage(source.name, arch, fmt, image, key, from_cache=False, log=log)
            self._memory[key] = result
            return result

    def _read(self, path: Path) -> bytes | None:
        if not self.use_disk:
            return None
        try:
            data = path.read_bytes()
        except OSError:
            return None
        return data or None

    def _write(self, path: Path, image: bytes) -> None:
        """Atomic write (temp file + rename) so a concurrent reader never sees half a file."""
        if not self.use_disk:
            return
        try:
            write_atomic(path, image)
        except OSError:
            pass


_DEFAULT: KernelCompiler | None = None


def default_compiler() -> KernelCompiler:
    """The process-wide compiler over `cache_dir()` (devices share its memory cache)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = KernelCompiler()
    return _DEFAULT
