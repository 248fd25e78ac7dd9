"""A tiny workload kind for testing the harness: no model, no device, instant runs.

`register()` adds this module as a plugin (its `flare_bench_workloads` hook
answers model `bench-fake`). It lives in the package (not in tests/) so a
plugin author can test a workload-independent change to the harness the same way.

Requests are the numbers 0..n-1; a runner answers `np.full(4, request * scale)`
(plus `drift * opens`, to fake a nondeterministic configuration) and logs every
open, so tests can see the order of runs.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flare.core.plugin_manager import get_plugin_manager, hookimpl

from .workload import FLARE_PEER, Metric, Option, Peer, Request, Timed, Workload, forget_workloads

LOG: list[str] = []


class FakeRunner:
    opens = 0

    def __init__(self, name: str, scale: float, drift: float):
        FakeRunner.opens += 1
        self.name, self.scale, self.offset = name, scale, drift * FakeRunner.opens
        self.description = f"fake runner {name}"
        LOG.append(name)

    def run(self, request: Request) -> Timed:
        return Timed(np.full(4, request.payload * self.scale + self.offset, np.float32), 0.001 * (1 + request.index))

    def memory_plan(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass


class FakeWorkload(Workload):
    model = "bench-fake"
    metric = Metric("items/s", "items", per_work=False)
    tolerance = 1e-3
    default_requests = 3
    peers = (FLARE_PEER, Peer("other", "a second fake peer"), Peer("missing", "needs a package", "no_such_module_x"))
    options = {
        "scale": Option(float, 1.0, "output multiplier"),
        "drift": Option(float, 0.0, "added per open (nondeterminism)"),
        "items": Option(int, 2, "work per request", minimum=1, shapes_requests=True),
        "mode": Option(str, "fast", "a choice", choices=("fast", "slow")),
        "files": Option("paths", ("builtin",), "files", keywords=("builtin",)),
    }

    def requests(self, config: Any, count: int) -> list[Request]:
        return [Request(i, float(i), float(config.options["items"])) for i in range(count)]

    def open_flare(self, config: Any) -> FakeRunner:
        return FakeRunner(config.name, config.options["scale"], config.options["drift"])


@hookimpl
def flare_bench_workloads() -> list[type[Workload]]:
    return [FakeWorkload]


def register() -> None:
    """Add this module to the process-wide plugin manager (idempotent)."""
    import sys

    pm = get_plugin_manager()
    module = sys.modules[__name__]
    if not pm.pm.is_registered(module):
        pm.register(module, name=__name__)
        forget_workloads()
