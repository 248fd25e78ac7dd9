"""The buffer ledger: every device allocation and free passes through here.

It is how tests prove "nothing leaked" (live counts and bytes back to where they
were), how benchmarks read peak bytes per device, and where fault injection
lives: `LEDGER.fail_at(n)` makes the n-th allocation from now fail *before*
the device is asked, exactly as a real out-of-memory would surface.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Iterator

from .errors import AllocationError


@dataclass
class DeviceStats:
    live_bytes: int = 0
    live_count: int = 0
    peak_bytes: int = 0
    total_allocs: int = 0
    total_frees: int = 0


@dataclass(frozen=True)
class Record:
    device: str
    nbytes: int
    tag: str


@dataclass(frozen=True)
class Snapshot:
    """Live allocations at one moment: compare two to find leaks."""

    live: dict[int, Record]
    stats: dict[str, tuple[int, int]]  # device -> (live_count, live_bytes)

    def bytes(self, device: str | None = None) -> int:
        return sum(r.nbytes for r in self.live.values() if device is None or r.device == device)

    def count(self, device: str | None = None) -> int:
        return sum(1 for r in self.live.values() if device is None or r.device == device)


@dataclass
class _Injection:
    countdown: int
    fired: int = 0
    seen: int = 0


class Ledger:
    """Process-wide record of device buffers (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._live: dict[int, Record] = {}
        self._stats: dict[str, DeviceStats] = {}
        self._injection: _Injection | None = None

    # -- the allocation path ------------------------------------------------
    def admit(self, device: str, nbytes: int, free: int) -> None:
        """Called before a device allocates: raises AllocationError for an injected
        fault or when `nbytes` exceeds what the device says is free."""
        with self._lock:
            inj = self._injection
            if inj is not None:
                inj.seen += 1
                if inj.seen == inj.countdown:
                    inj.fired += 1
                    raise AllocationError(device, nbytes, free, "injected fault")
        if nbytes > free:
            raise AllocationError(device, nbytes, free)

    def record_alloc(self, device: str, nbytes: int, tag: str) -> int:
        with self._lock:
            lid = next(self._ids)
            self._live[lid] = Record(device, int(nbytes), tag)
            st = self._stats.setdefault(device, DeviceStats())
            st.live_bytes += nbytes
            st.live_count += 1
            st.total_allocs += 1
            st.peak_bytes = max(st.peak_bytes, st.live_bytes)
            return lid

    def record_free(self, lid: int) -> None:
        with self._lock:
            rec = self._live.pop(lid, None)
            if rec is None:
                raise RuntimeError(f"ledger: buffer {lid} freed twice or never allocated")
            st = self._stats[rec.device]
            st.live_bytes -= rec.nbytes
            st.live_count -= 1
            st.total_frees += 1

    # -- reading ----------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(dict(self._live), {d: (s.live_count, s.live_bytes) for d, s in self._stats.items()})

    def stats(self, device: str) -> DeviceStats:
        with self._lock:
            st = self._stats.get(device, DeviceStats())
            return DeviceStats(**vars(st))

    def live_bytes(self, device: str | None = None) -> int:
        """Bytes live on `device` (all devices: None), from the running totals `record_alloc` and
        `record_free` keep: devices ask it on every allocation (`memory()`), and summing every live
        record there made each allocation cost O(live buffers) (a Piper runner holds thousands)."""
        with self._lock:
            if device is not None:
                st = self._stats.get(device)
                return st.live_bytes if st is not None else 0
            return sum(st.live_bytes for st in self._stats.values())

    def live_records(self, device: str | None = None) -> list[Record]:
        with self._lock:
            return [r for r in self._live.values() if device is None or r.device == device]

    def reset_peak(self, device: str | None = None) -> None:
        """Start a new peak measurement at the current live bytes."""
        with self._lock:
            for name, st in self._stats.items():
                if device is None or name == device:
                    st.peak_bytes = st.live_bytes

    def peak_bytes(self, device: str) -> int:
        return self.stats(device).peak_bytes

    # -- fault injection ------------------------------------------------------
    @contextlib.contextmanager
    def fail_at(self, n: int) -> Iterator[_Injection]:
        """Within the block, the n-th allocation (1-based, any device) fails with
        AllocationError. The yielded object tells whether it fired."""
        inj = _Injection(countdown=n)
        with self._lock:
            if self._injection is not None:
                raise RuntimeError("fault injection is already active")
            self._injection = inj
        try:
            yield inj
        finally:
            with self._lock:
                self._injection = None

    @contextlib.contextmanager
    def count_allocations(self) -> Iterator[_Injection]:
        """Count allocations in the block without failing any (to size fail_at sweeps)."""
        with self.fail_at(0) as inj:
            yield inj


LEDGER = Ledger()
