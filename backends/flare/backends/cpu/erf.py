"""erf for the CPU backend: NumPy has none, and GELU needs it.

A tiny C kernel (libm's `erff`) compiled once with cffi into the cache
directory; where no compiler is present the pure-NumPy fallback (Abramowitz &
Stegun 7.1.26, |error| < 1.5e-7) is used. Both are
checked against `math.erf` by the conformance tests of `gelu`.

Built (or loaded from the cache) at the first erf, not at import: importing the CPU backend
is part of every `flare` command's start-up (the plugin manager loads every backend), and
with an empty cache the build (cffi, setuptools, a compiler run) cost ~1 s of a cold
`flare run silero-vad --backends vulkan` that never computes an erf.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from .native.build import build

_C_SOURCE = """
#include <math.h>
void flare_erf(const float *x, float *y, long n) { for (long i = 0; i < n; ++i) y[i] = erff(x[i]); }
"""
_CDEF = "void flare_erf(const float *x, float *y, long n);"
_lib = None
_ffi = None
BACKEND = "numpy"
_loaded = False
_load_lock = threading.Lock()  # the first erf of two threads at once: one builds, the other waits


def _load_c() -> None:
    """Build (once) and load the cffi module; leave the fallback on any failure."""
    global _lib, _ffi, BACKEND, _loaded
    with _load_lock:
        if _loaded:
            return
        if not os.environ.get("FLARE_CPU_NO_CFFI"):
            try:
                module = build("_flare_erf", _C_SOURCE, _CDEF)
                _lib, _ffi, BACKEND = module.lib, module.ffi, "cffi"
            except Exception:  # no cffi, no compiler, read-only cache...: the NumPy path still works
                _lib = _ffi = None
        _loaded = True


def _erf_numpy(x: np.ndarray, out: np.ndarray) -> None:
    a = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    y = 1.0 - poly * np.exp(-a * a)
    np.copyto(out, np.copysign(y, x).astype(np.float32))


def backend() -> str:
    """Which erf runs: "cffi" (libm's erff, built on first use) or "numpy" (the fallback)."""
    if not _loaded:
        _load_c()
    return BACKEND


def erf_into(x: np.ndarray, out: np.ndarray) -> None:
    """out[...] = erf(x) for float32 arrays (out may be x)."""
    if not _loaded:
        _load_c()
    if _lib is not None and x.flags.c_contiguous and out.flags.c_contiguous:
        src = np.ascontiguousarray(x, np.float32)
        _lib.flare_erf(_ffi.cast("const float *", src.ctypes.data), _ffi.cast("float *", out.ctypes.data), src.size)
        return
    _erf_numpy(x, out)
