"""Threads of the native executor: how many (physical cores) and the pool that runs them.

`physical_cores()` counts cores, not hardware threads: two hyper-threads of one core share
its vector units, and the C kernels are FMA-bound, so a second thread per core adds
contention, not speed (llama.cpp and onnxruntime default the same way). Only the CPUs this
process may run on count (its affinity mask: a container or `taskset` limit).

`ThreadPool` owns one `flare_pool` (native/pool.c): `threads - 1` persistent workers that
sleep between calls. One per `CpuDevice`, created with it and freed by `close()`; every split
compiled on the device runs its command lists on it. A pool runs one command list at a
time: a second caller, from another Python thread, runs its list on its own thread instead
of waiting (same results: the kernels split by output ranges only).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def physical_cores() -> int:
    """Physical cores among the CPUs this process may use (>= 1)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores = set()
            break
    if cores:
        return len(cores)
    return _cores_from_cpuinfo(set(allowed)) or max(1, len(allowed))


def _cores_from_cpuinfo(allowed: set[int]) -> int:
    """(physical id, core id) pairs of the allowed processors in /proc/cpuinfo; 0 if unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return 0
    cores = set()
    for block in text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "processor" not in fields or "core id" not in fields:
            continue
        if int(fields["processor"]) in allowed:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores)


class ThreadPool:
    """A native `flare_pool` of `threads` threads (the caller included); none for one thread."""

    def __init__(self, native: Any, threads: int):
        self._lib, self._ffi = native.lib, native.ffi
        self.threads = int(threads)
        self.ptr = self._ffi.NULL
        if self.threads > 1:
            ptr = self._lib.flare_pool_new(self.threads)
            if ptr == self._ffi.NULL:
                raise RuntimeError(f"could not start {self.threads - 1} CPU worker threads")
            self.ptr = ptr

    def regions(self) -> int:
        """Command lists run on all threads so far (not those a busy pool left to their caller)."""
        return int(self._lib.flare_pool_regions(self.ptr)) if self.ptr != self._ffi.NULL else 0

    def close(self) -> None:
        """Stop and join the workers (idempotent). No command list may be running on it."""
        ptr, self.ptr = self.ptr, self._ffi.NULL
        if ptr != self._ffi.NULL:
            self._lib.flare_pool_free(ptr)
