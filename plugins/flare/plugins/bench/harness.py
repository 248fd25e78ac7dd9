"""Running a comparison: A->B->B->A blocks over the same requests, warmed, timed, compared.

Before the first block each configuration is opened once and served its
warm-up requests, unrecorded, so imports, file caches and compiled kernels
do not land on whichever run comes first. Then each run opens its
configuration afresh (outside the timings; the ledger
and RSS peaks cover opening and serving, so a configuration's memory is its
whole footprint), serves `warmup` requests untimed, then every request
timed, then closes. Outputs of every run are compared with the first run of
the same configuration (determinism) and A's first run with B's.
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .compare import OutputCheck, compare_outputs
from .config import BenchConfig, check_pair
from .memory import MemoryPeak, PeakWatch
from .order import Slot, abba, pairs
from .stats import median, percentile, ratio
from .workload import Metric, Request, Workload

# progress(slot, requests done in this run, requests per run, phase); phase is "prime" (before the
# blocks, unrecorded), "open", "warmup", "run" or "done"
Progress = Callable[[Slot, int, int, str], None]


@dataclass
class RunResult:
    """One run of one configuration."""

    slot: Slot
    latencies_s: list[float]
    work: float
    setup_s: float
    memory: MemoryPeak
    metric_value: float
    vs_first: OutputCheck | None = None   # this run's outputs vs the configuration's first run
    extras: dict[str, list[float]] = field(default_factory=dict)   # per-request figures by name

    @property
    def total_s(self) -> float:
        return float(sum(self.latencies_s))

    def to_json(self) -> dict[str, Any]:
        return {"config": self.slot.key, "block": self.slot.block, "position": self.slot.position,
                "index": self.slot.index, "latencies_s": self.latencies_s, "total_s": self.total_s,
                "work": self.work, "metric": self.metric_value, "setup_s": self.setup_s,
                "memory": self.memory.to_json(), "extras": self.extras,
                "vs_first_run": self.vs_first.to_json() if self.vs_first is not None else None}


@dataclass
class ConfigSummary:
    """A configuration's figures over all its runs."""

    metric: float                 # median of its runs' metric
    latency_median_s: float       # over every timed request of every run
    latency_p90_s: float
    ledger_peak_bytes: dict[str, int]
    peak_rss_bytes: int
    rss_growth_bytes: int         # max over runs of the peak's rise above the run's start
    setup_median_s: float
    deterministic: bool
    runner: str
    memory_plan: dict[str, Any] | None
    extras: dict[str, float] = field(default_factory=dict)   # median of each per-request figure

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "latency_median_s": self.latency_median_s, "latency_p90_s": self.latency_p90_s,
                "ledger_peak_bytes": self.ledger_peak_bytes, "peak_rss_bytes": self.peak_rss_bytes,
                "rss_growth_bytes": self.rss_growth_bytes,
                "setup_median_s": self.setup_median_s, "deterministic": self.deterministic, "runner": self.runner,
                "memory_plan": self.memory_plan, "extras": self.extras}


@dataclass
class PairRatio:
    """B/A of one adjacent pair of runs."""

    block: int
    a_run: int
    b_run: int
    metric: float
    ledger_peak: float
    rss_growth: float

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()


@dataclass
class BenchResult:
    model: str
    metric: Metric
    configs: dict[str, BenchConfig]
    descriptions: dict[str, str]
    blocks: int
    requests: list[Request]
    warmup: int
    runs: list[RunResult]
    summaries: dict[str, ConfigSummary]
    pairs: list[PairRatio]
    outputs: OutputCheck
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Outputs of A and B agree (within tolerance) and each configuration is deterministic."""
        return self.outputs.within_tolerance and all(s.deterministic for s in self.summaries.values())

    def ratio(self, name: str = "metric") -> dict[str, float]:
        vals = [getattr(p, name) for p in self.pairs]
        finite = [v for v in vals if not np.isnan(v)]
        return {"median": median(finite), "min": min(finite, default=float("nan")),
                "max": max(finite, default=float("nan")), "pairs": len(finite), "of": len(vals)}


def machine_info() -> dict[str, Any]:
    import os

    from flare.core import __version__

    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "flare": __version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run_bench(a: BenchConfig, b: BenchConfig, *, blocks: int = 2, requests: int | None = None,
              warmup: int | None = None, progress: Progress | None = None,
              workload: Workload | None = None) -> BenchResult:
    """Compare configurations A and B (same model, same requests) in `blocks` A B B A blocks.

    `warmup`: untimed requests at the start of each run; None (the default) serves every request
    once, so each input shape has its plan before the timing starts (a steady state: a prepared
    model pays for a new shape once in its life, not once per benchmark run)."""
    workload = workload or check_pair(a, b)
    count = requests if requests is not None else workload.default_requests
    if count < 1:
        raise ValueError(f"requests must be >= 1, got {count}")
    reqs = workload.requests(a, count)
    warmup = len(reqs) if warmup is None else warmup
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    configs = {"A": a, "B": b}
    first_outputs: dict[str, list[np.ndarray]] = {}
    runs: list[RunResult] = []
    plans: dict[str, dict[str, Any] | None] = {}
    descriptions: dict[str, str] = {}
    watch = PeakWatch()
    for key in ("A", "B"):        # prime: load libraries, caches and files once, before anything is measured
        if progress:
            progress(abba(1)[0 if key == "A" else 1], 0, len(reqs), "prime")
        runner = workload.open(configs[key])
        try:
            for i in range(max(1, warmup)):
                runner.run(reqs[i % len(reqs)])
        finally:
            runner.close()
    for slot in abba(blocks):
        cfg = configs[slot.key]
        if progress:
            progress(slot, 0, len(reqs), "open")
        watch.start()
        t0 = time.perf_counter()
        runner = workload.open(cfg)
        try:
            setup_s = time.perf_counter() - t0
            descriptions.setdefault(slot.key, runner.description)
            for i in range(warmup):
                if progress:
                    progress(slot, 0, len(reqs), "warmup")
                runner.run(reqs[i % len(reqs)])
            latencies, outputs, extras = [], [], {}
            for i, req in enumerate(reqs):
                timed = runner.run(req)
                latencies.append(timed.seconds)
                outputs.append(np.asarray(timed.output))
                for name, value in timed.extras.items():
                    extras.setdefault(name, []).append(float(value))
                if progress:
                    progress(slot, i + 1, len(reqs), "run")
            if slot.key not in plans:
                plans[slot.key] = plan_summary(runner.memory_plan())
        finally:
            runner.close()
        peak = watch.stop()
        work = float(sum(r.work for r in reqs))
        result = RunResult(slot, latencies, work, setup_s, peak, workload.metric.value(sum(latencies), work),
                           extras=extras)
        if slot.key in first_outputs:
            result.vs_first = compare_outputs(first_outputs[slot.key], outputs, 0.0)
        else:
            first_outputs[slot.key] = outputs
        runs.append(result)
        if progress:
            progress(slot, len(reqs), len(reqs), "done")
    summaries = {key: _summarize([r for r in runs if r.slot.key == key], descriptions[key], plans.get(key))
                 for key in configs}
    pair_ratios = [_pair(runs[ia], runs[ib]) for ia, ib in pairs(blocks)]
    check = compare_outputs(first_outputs["A"], first_outputs["B"], workload.tolerance)
    return BenchResult(a.model, workload.metric, configs, descriptions, blocks, reqs, warmup, runs, summaries,
                       pair_ratios, check, machine_info())


def plan_summary(describe: dict[str, Any] | None) -> dict[str, Any] | None:
    """The memory part of PreparedGraph.describe(): per entry its shapes, nodes, splits and arena
    bytes (planned / liveness lower bound / one buffer per tensor) per device; persistent and
    workspace bytes per device."""
    if describe is None:
        return None
    entries = {}
    for name, e in describe.get("entries", {}).items():
        entries[name] = {k: e[k] for k in ("shapes", "nodes", "splits", "copies") if k in e}
        entries[name]["arena"] = {dev: {k: a[k] for k in ("planned", "lower_bound", "naive") if k in a}
                                  for dev, a in e.get("arena", {}).items()}
    return {"entries": entries, "persistent_bytes": dict(describe.get("persistent_bytes", {})),
            "workspace_bytes": dict(describe.get("workspace_bytes", {}))}


def _summarize(runs: Sequence[RunResult], runner: str, plan: dict[str, Any] | None) -> ConfigSummary:
    lat = [s for r in runs for s in r.latencies_s]
    devices: dict[str, int] = {}
    for r in runs:
        for dev, n in r.memory.devices.items():
            devices[dev] = max(devices.get(dev, 0), n)
    return ConfigSummary(
        metric=median([r.metric_value for r in runs]), latency_median_s=median(lat),
        latency_p90_s=percentile(lat, 90), ledger_peak_bytes=devices,
        peak_rss_bytes=max(r.memory.rss_bytes for r in runs),
        rss_growth_bytes=max(r.memory.rss_growth_bytes for r in runs), setup_median_s=median([r.setup_s for r in runs]),
        deterministic=all(r.vs_first is None or r.vs_first.identical for r in runs), runner=runner,
        memory_plan=plan,
        extras={name: median([v for r in runs for v in r.extras.get(name, [])])
                for name in dict.fromkeys(n for r in runs for n in r.extras)})


def _pair(a: RunResult, b: RunResult) -> PairRatio:
    return PairRatio(a.slot.block, a.slot.index, b.slot.index, ratio(b.metric_value, a.metric_value),
                     ratio(sum(b.memory.devices.values()), sum(a.memory.devices.values())),
                     ratio(b.memory.rss_growth_bytes, a.memory.rss_growth_bytes))
