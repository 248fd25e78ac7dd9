"""Peak memory of one run: ledger bytes per device and the process's peak RSS.

The ledger sees every device buffer Flare allocates, so its peak (minus what
was live before the run) is the run's device footprint: weights, state,
inputs and arenas. Peers allocate nothing through the ledger; for them (and
for Flare's host-side overhead) the process's resident set is the measure.

`getrusage(...).ru_maxrss` only ever grows, so a later run would inherit an
earlier run's peak. On Linux, writing "5" to /proc/self/clear_refs resets the
peak to the current RSS; when that works each run's peak is its own
(`rss_scope = "run"`), otherwise it is the process's peak so far
(`rss_scope = "process"`) and the report says so.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from flare.core.ledger import LEDGER


try:
    import resource
except ImportError:  # Windows: no getrusage; peak RSS is reported as 0
    resource = None  # type: ignore[assignment]


def reset_rss_peak() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def rss_peak_bytes() -> int:
    """Peak resident set size of this process (since the last reset, where supported)."""
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes; Linux: KiB


def current_rss_bytes() -> int:
    """Resident set size now (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * (resource.getpagesize() if resource else 4096)
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class MemoryPeak:
    """Peak bytes above the run's starting point per ledger device, and peak RSS."""

    devices: dict[str, int] = field(default_factory=dict)
    rss_bytes: int = 0            # peak resident set of the process during the run
    rss_start_bytes: int = 0      # resident set when the run started
    rss_scope: str = "run"

    @property
    def rss_growth_bytes(self) -> int:
        """How far the peak rose above the run's start: the run's own host memory."""
        return max(0, self.rss_bytes - self.rss_start_bytes)

    def to_json(self) -> dict:
        return {"ledger_peak_bytes": dict(self.devices), "peak_rss_bytes": self.rss_bytes,
                "rss_start_bytes": self.rss_start_bytes, "rss_growth_bytes": self.rss_growth_bytes,
                "rss_scope": self.rss_scope}


class PeakWatch:
    """`start()` before opening a configuration, `stop()` after its last request."""

    def __init__(self) -> None:
        self._baseline: dict[str, int] = {}
        self._rss_reset = False
        self._rss_start = 0

    def start(self) -> None:
        snap = LEDGER.snapshot()
        self._baseline = {dev: live for dev, (_, live) in snap.stats.items()}
        LEDGER.reset_peak()
        self._rss_reset = reset_rss_peak()
        self._rss_start = rss_peak_bytes() if self._rss_reset else current_rss_bytes()

    def stop(self) -> MemoryPeak:
        devices = {}
        for dev in LEDGER.snapshot().stats:
            peak = LEDGER.peak_bytes(dev) - self._baseline.get(dev, 0)
            if peak > 0:
                devices[dev] = peak
        return MemoryPeak(devices, rss_peak_bytes(), self._rss_start, "run" if self._rss_reset else "process")
