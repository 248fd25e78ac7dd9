"""What every bench peer (onnxruntime, NumPy, torch: another way to serve a workload's requests) shares."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from .workload import Request, Timed, timed_output


class PeerRunner:
    """What every peer shares: it times `compute(payload)`, has no memory plan, and
    drops its model on close. Subclasses set `description` and implement `compute`
    (which may return `(output, extras)`: per-request figures it times itself)."""

    description = ""

    def compute(self, payload: Any) -> np.ndarray:
        raise NotImplementedError

    def run(self, request: Request) -> Timed:
        t0 = time.perf_counter()
        timed = timed_output(self.compute(request.payload), time.perf_counter() - t0)
        timed.output = np.asarray(timed.output, np.float32)
        return timed

    def memory_plan(self) -> None:
        return None

    def close(self) -> None:
        self.__dict__.clear()
