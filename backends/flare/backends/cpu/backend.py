"""The CPU backend: the plugin's entry (probe, open devices) and its settings.

Config and environment are read here (`count`, `memory_limit`, `max_buffer`,
`native`, `threads`); each logical device is a `CpuDevice` (device.py).
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping

import numpy as np

from flare.core.backend import Backend, ProbeResult
from flare.core.errors import BackendUnavailable

from . import native as native_mod
from .device import CpuDevice

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_bytes(text: str | int) -> int:
    """'64MiB' -> 67108864; plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a size from {text!r} (e.g. 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def apply_blas_threads(threads: int | None, native: bool) -> None:
    """Set the BLAS thread count (process-wide: NumPy and the C kernels share the library).

    With the native executor BLAS runs single-threaded: the executor's own pool splits each
    BLAS call by rows or columns (one thread owning each core; OpenBLAS threads spinning next
    to the pool's would take cores from it). The NumPy executor gives BLAS `threads`, or
    leaves it to OPENBLAS_NUM_THREADS / OMP_NUM_THREADS when `threads` was not set."""
    from .native.blas import find_blas
    if native:
        n = 1
    elif threads is not None:
        n = threads
    elif any(os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        return
    else:
        from .native.threads import physical_cores
        n = physical_cores()
    blas = native_mod.load().blas if native and native_mod.load() is not None else find_blas()
    if blas is not None:
        blas.set_threads(n)


def _size_setting(config: Mapping[str, Any], key: str, env: str | None) -> int | None:
    """A byte size from the config or the environment; InputError naming where it came from."""
    from flare.core.errors import InputError

    where, value = f"cpu config {key!r}", config.get(key)
    if value in (None, "") and env is not None:
        where, value = env, os.environ.get(env)
    if value in (None, ""):
        return None
    try:
        size = parse_bytes(value)
    except ValueError as exc:
        raise InputError(f"{where}={value!r}: {exc}") from None
    if size < 1:
        raise InputError(f"{where}={value!r}: must be at least 1 byte")
    return size


def _thread_setting(config: Mapping[str, Any]) -> int | None:
    """Threads from the config (`threads`) or FLARE_CPU_THREADS (None: one per physical core);
    InputError naming where."""
    from flare.core.errors import InputError

    where, value = "cpu config 'threads'", config.get("threads")
    if value in (None, ""):
        where, value = "FLARE_CPU_THREADS", os.environ.get("FLARE_CPU_THREADS")
    if value in (None, ""):
        return None
    try:
        threads = int(str(value).strip())
    except ValueError:
        raise InputError(f"{where}={value!r}: expected a whole number of threads") from None
    if not 1 <= threads <= 4096:
        raise InputError(f"{where}={value!r}: must be between 1 and 4096")
    return threads


class CpuBackend(Backend):
    """Always usable. Config: `count` logical devices, `memory_limit`, `max_buffer`,
    `native` (default true: the C executor where it builds), `threads` (threads of the C kernels,
    default one per physical core; see native/threads.py).

    Environment: FLARE_CPU_MEMORY_LIMIT (e.g. 256MiB) applies to every CPU device.
    """

    name = "cpu"

    @classmethod
    def probe(cls) -> ProbeResult:
        from .erf import backend as erf_backend
        from .native.threads import physical_cores
        native_mod.load()
        return ProbeResult(True, f"NumPy {np.__version__}, erf via {erf_backend()}; native executor: {native_mod.REASON}; "
                                 f"{physical_cores()} physical core(s) (default threads)", ("cpu:0",))

    @classmethod
    def open_devices(cls, config: Mapping[str, Any] | None = None) -> list[CpuDevice]:
        config = dict(config or {})
        count = int(config.get("count", 1))
        if count < 1:
            raise BackendUnavailable(f"cpu: count must be >= 1, got {count}")
        limit = _size_setting(config, "memory_limit", "FLARE_CPU_MEMORY_LIMIT")
        max_buffer = _size_setting(config, "max_buffer", None)
        native = str(config.get("native", "1")).strip().lower() not in ("0", "false", "no", "off")
        threads = _thread_setting(config)
        devices = [CpuDevice(f"cpu:{i}", limit, max_buffer, native, threads) for i in range(count)]
        apply_blas_threads(threads, devices[0].native is not None)
        return devices

