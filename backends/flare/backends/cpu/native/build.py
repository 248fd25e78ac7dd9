"""Compile a C source with cffi (API mode) once and load it from the cache.

The module name carries a hash of the source, the compiler flags and the
Python version, so an edited kernel or a different interpreter builds anew and
an unchanged one loads in milliseconds. Flags are portable (`-O3`, no
`-march=native`): a cache folder shared between machines never holds code
that needs instructions the loading machine lacks.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

from flare.core.cache import cache_dir

PORTABLE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd", "-std=gnu11", "-pthread")


def build(prefix: str, source: str, cdef: str, flags: tuple[str, ...] = PORTABLE_FLAGS,
          libraries: tuple[str, ...] = ("m",), sources: tuple[Path, ...] = (),
          include_dirs: tuple[Path, ...] = (), announce: str | None = None) -> ModuleType:
    """Return the compiled cffi module (`.lib`, `.ffi`); raises if cffi or a compiler is missing.

    `sources` are further C files compiled into the same module, `include_dirs` where its
    headers are; their text (and every header in `include_dirs`) is part of the cache key.
    `announce`, when given, is printed to stderr before a build (a build takes seconds, and a
    silent first run looks hung), with the cache folder.
    """
    import cffi

    parts = [source, cdef, " ".join(flags), " ".join(libraries), sys.version]
    parts += [Path(p).read_text() for p in sources]
    parts += [h.read_text() for d in include_dirs for h in sorted(Path(d).glob("*.h"))]
    name = f"{prefix}_{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:12]}"
    folder = cache_dir("cffi")
    built = sorted(folder.glob(f"{name}*.so"))
    if not built:
        if announce:
            print(f"{announce} (once, cached in {folder})", file=sys.stderr, flush=True)
        ffi = cffi.FFI()
        ffi.cdef(cdef)
        ffi.set_source(name, source, libraries=list(libraries), extra_compile_args=list(flags),
                       sources=[str(p) for p in sources], include_dirs=[str(d) for d in include_dirs])
        tmp = folder / f"build-{name}-{os.getpid()}"
        try:
            path = ffi.compile(tmpdir=str(tmp), verbose=False)
            final = folder / Path(path).name
            os.replace(path, final)  # atomic: a concurrent builder replaces an identical file
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        built = [final]
    spec = importlib.util.spec_from_file_location(name, built[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    # `python3 -m flare.backends.cpu.native.build`: build the native CPU kernels now (install time),
    # so the first `flare run` does not; prints what it built or why the NumPy path will be used.
    from flare.backends.cpu import native

    loaded = native.load()
    print(f"flare CPU kernels: {native.REASON}")
    sys.exit(0 if loaded is not None else 1)
