"""Prometheus metrics of one server (its own registry, so two servers in a process never mix).

Counters and the time-to-first-token histogram are updated by the step loop;
gauges that describe state owned elsewhere (prefix cache, speculative
acceptance, ledger bytes per device, the step loop thread's CPU seconds) are
read when `/metrics` is scraped.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class _Live(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]]):
        self.read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        s = self.read()
        mem = GaugeMetricFamily("flare_memory_bytes", "Ledger bytes per device", labels=["device", "kind"])
        for dev, m in s.get("memory", {}).items():
            for kind in ("live_bytes", "peak_bytes", "persistent_bytes", "workspace_bytes"):
                if kind in m:
                    mem.add_metric([dev, kind.removesuffix("_bytes")], float(m[kind]))
        yield mem
        cpu = s.get("step_loop_cpu_seconds")
        if cpu is not None:
            yield GaugeMetricFamily("flare_step_loop_cpu_seconds", "CPU seconds of the step loop's thread so far",
                                    value=float(cpu))
        pc = s.get("prefix_cache") or {}
        for key, doc in (("blocks", "Prefix-cache blocks held"), ("bytes", "Prefix-cache bytes"),
                         ("memory_bytes", "Prefix-cache memory allocated (slabs, in the ledger)"),
                         ("hits", "Requests that reused cached KV blocks"),
                         ("reused_tokens", "Prompt tokens taken from the prefix cache"),
                         ("evictions", "Prefix-cache blocks evicted")):
            yield GaugeMetricFamily(f"flare_prefix_cache_{key}", doc, value=float(pc.get(key, 0)))
        sp = s.get("speculative") or {}
        yield GaugeMetricFamily("flare_speculative_proposed_tokens", "Draft tokens proposed",
                                value=float(sp.get("proposed", 0)))
        yield GaugeMetricFamily("flare_speculative_accepted_tokens", "Draft tokens accepted",
                                value=float(sp.get("accepted", 0)))
        yield GaugeMetricFamily("flare_speculative_acceptance_ratio", "Accepted / proposed draft tokens",
                                value=float(sp.get("acceptance") or 0.0))


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("flare_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.rejected = Counter("flare_rejected_requests", "Requests refused before queueing", ["status"], registry=r)
        self.prompt_tokens = Counter("flare_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated = Counter("flare_generated_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("flare_time_to_first_token_seconds", "From arrival to the first token", registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.queue_depth = Gauge("flare_queue_depth", "Requests waiting for a sequence slot", registry=r)
        self.running = Gauge("flare_running_requests", "Requests holding a sequence slot", registry=r)
        self.steps = Counter("flare_steps", "Model steps by kind", ["kind"], registry=r)

    def watch(self, read: Callable[[], dict[str, Any]]) -> None:
        """Add gauges read at scrape time from `read()` (memory, prefix cache, speculative)."""
        self.registry.register(_Live(read))

    def text(self) -> bytes:
        return generate_latest(self.registry)
