"""`flare bench` for any registered model that brings no workload of its own.

A third-party model plugin that registers only a `ModelSpec` can still be
benchmarked: each request executes every entry point of the model's graph on
zeros of its first shapes, prepared through `Session.prepare_model` (so the
model's placement and expert-staging callbacks apply, as in `flare run` and
`flare describe`). The metric is graph executes per second; compare two
device lists or prepared vs rebuilt. Any key under `[options]` is handed to
the model's `graph(options)` as it is (what `--option KEY=VALUE` does for
`flare run` and `flare describe`); the model itself rejects what it does not know.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .flare_runner import FlareRunner
from .workload import Metric, Request, Workload

if TYPE_CHECKING:
    from .config import BenchConfig


class GraphModel:
    """The model prepared on a session, with zero inputs for each entry."""

    def __init__(self, session: Any, model: str, options: Mapping[str, Any] | None = None):
        from flare.core.dtypes import to_numpy

        self.pg = session.prepare_model(model, dict(options or {}))
        self.inputs = {}
        for entry in sorted(self.pg.entries):
            plan = self.pg.current_plan(entry)
            self.inputs[entry] = {n: np.zeros(t.shape, to_numpy(t.dtype)) for n, t in plan.graph.inputs.items()}

    def run(self) -> np.ndarray:
        outs = []
        for entry, inputs in self.inputs.items():
            for _, array in sorted(self.pg.execute(entry, **inputs).items()):
                outs.append(np.asarray(array, np.float32).ravel())
        return np.concatenate(outs) if outs else np.zeros(0, np.float32)

    def release(self) -> None:
        self.pg.release()


class GraphWorkload(Workload):
    """Every entry of a registered model's graph on zeros, once per request."""

    metric = Metric("executes/s", "executes", per_work=False)
    tolerance = 1e-5
    threads_supported = True
    default_requests = 8
    free_options = True

    def __init__(self, model: str):
        self.model = model

    def requests(self, config: "BenchConfig", count: int) -> list[Request]:
        return [Request(i, None, 1.0, "every entry on zeros") for i in range(count)]

    def open_flare(self, config: "BenchConfig") -> FlareRunner:
        options = dict(config.options)
        return FlareRunner(config, lambda session: GraphModel(session, self.model, options),
                           lambda m, request: m.run())
