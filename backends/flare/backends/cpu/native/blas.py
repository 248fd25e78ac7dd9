"""The BLAS the native kernels call: the OpenBLAS NumPy already loaded.

NumPy wheels ship `scipy_openblas` (ILP64, symbols `scipy_cblas_sgemm64_`...);
other builds may link a plain OpenBLAS (`cblas_sgemm`). We find the library in
this process's memory map (it is loaded with NumPy, so this costs nothing and
matches NumPy's results), open it with cffi's ABI mode and hand the function
pointers to the C executor. Its thread count is the one knob both NumPy and the
native path share (`set_threads`).
"""
from __future__ import annotations

import functools
import glob
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

# (sgemm, sgemv, set_num_threads, get_num_threads, ilp64)
_SYMBOLS = (
    ("scipy_cblas_sgemm64_", "scipy_cblas_sgemv64_", "scipy_openblas_set_num_threads64_",
     "scipy_openblas_get_num_threads64_", True),
    ("cblas_sgemm64_", "cblas_sgemv64_", "openblas_set_num_threads64_", "openblas_get_num_threads64_", True),
    ("scipy_cblas_sgemm", "scipy_cblas_sgemv", "scipy_openblas_set_num_threads",
     "scipy_openblas_get_num_threads", False),
    ("cblas_sgemm", "cblas_sgemv", "openblas_set_num_threads", "openblas_get_num_threads", False),
)


@dataclass
class Blas:
    path: str
    sgemm: int          # function addresses, for flare_set_blas
    sgemv: int
    ilp64: bool
    _lib: Any
    _set: str | None
    _get: str | None

    def set_threads(self, n: int) -> None:
        if self._set:
            getattr(self._lib, self._set)(int(n))

    def threads(self) -> int | None:
        return int(getattr(self._lib, self._get)()) if self._get else None


def _candidates() -> list[str]:
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "blas" in os.path.basename(path).lower() and path not in found:
                    found.append(path)
    except OSError:
        pass
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    found += [p for p in sorted(glob.glob(os.path.join(libs, "*openblas*"))) if p not in found]
    return found


@functools.lru_cache(maxsize=None)
def find_blas() -> Blas | None:
    """The first loaded (or NumPy-shipped) OpenBLAS exposing sgemm and sgemv, or None."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef("""
        void scipy_cblas_sgemm64_(void); void scipy_cblas_sgemv64_(void);
        void cblas_sgemm64_(void); void cblas_sgemv64_(void);
        void scipy_cblas_sgemm(void); void scipy_cblas_sgemv(void);
        void cblas_sgemm(void); void cblas_sgemv(void);
        void scipy_openblas_set_num_threads64_(int); int scipy_openblas_get_num_threads64_(void);
        void openblas_set_num_threads64_(int); int openblas_get_num_threads64_(void);
        void scipy_openblas_set_num_threads(int); int scipy_openblas_get_num_threads(void);
        void openblas_set_num_threads(int); int openblas_get_num_threads(void);
    """)
    for path in _candidates():
        try:
            lib = ffi.dlopen(path)
        except OSError:
            continue
        for gemm, gemv, set_t, get_t, ilp64 in _SYMBOLS:
            try:
                pg, pv = ffi.addressof(lib, gemm), ffi.addressof(lib, gemv)
            except (AttributeError, NotImplementedError):
                continue
            setter = getter = None
            try:
                ffi.addressof(lib, set_t), ffi.addressof(lib, get_t)
                setter, getter = set_t, get_t
            except (AttributeError, NotImplementedError):
                pass
            return Blas(path, int(ffi.cast("uintptr_t", pg)), int(ffi.cast("uintptr_t", pv)), ilp64,
                        lib, setter, getter)
    return None
