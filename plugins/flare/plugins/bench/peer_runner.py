"""What every bench peer (onnxruntime, NumPy, torch: another way to serve a workload's requests) shares."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from .workload import Request, Timed


class PeerRunner:
    """What every peer shares: it times `compute(payload)`, has no memory plan, and
    drops its model on close. Subclasses set `description` and implement `compute`."""

    description = ""

    def compute(self, payload: Any) -> np.ndarray:
        raise NotImplementedError

    def run(self, request: Request) -> Timed:
        t0 = time.perf_counter()
        out = self.compute(request.payload)
        return Timed(np.asarray(out, np.float32), time.perf_counter() - t0)

    def memory_plan(self) -> None:
        return None

    def close(self) -> None:
        self.__dict__.clear()
