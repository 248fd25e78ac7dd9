"""Where expert staging's time goes in a bench workload: resident against offload, per entry point.

`flare bench resident.toml offload.toml` gives one ratio for a whole request; this runs the same
two configurations (a workload whose model has expert staging: gguf, moe-lm) on the bench's own
requests, alternated run by run in one process, and splits each request's time by entry point
(prefill, decode, mixed: the graph's executes), with the offload side's host-step time (the
`stage_experts` calls), the stager's own time and the experts it copied per entry.
Times are thread CPU seconds (the work runs on the calling thread with one compute thread), p10
over the runs, so a shared machine's load disturbs them less than wall time; ratios only mean
something side by side.

    OPENBLAS_NUM_THREADS=1 python bench/staging_breakdown.py \\
        bench/configs/gguf_moe_resident.toml bench/configs/gguf_moe_offload.toml [--runs 20]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("resident")
    ap.add_argument("offload")
    ap.add_argument("--runs", type=int, default=20, help="runs of the bench's requests per side")
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()

    from flare.core import host_calls
    from flare.core.specs import STAGE_EXPERTS
    from flare.plugins.bench.config import check_pair, load_config

    host = [0.0]
    plain_run = host_calls.HostStep.run

    def timed_run(self, *a, **k):                      # the offload side's host steps
        t0 = time.thread_time()
        try:
            plain_run(self, *a, **k)
        finally:
            host[0] += time.thread_time() - t0

    host_calls.HostStep.run = timed_run
    configs = {"resident": load_config(args.resident), "offload": load_config(args.offload)}
    workload = check_pair(configs["resident"], configs["offload"])
    requests = workload.requests(configs["resident"], args.requests)
    runners = {side: workload.open_flare(c) for side, c in configs.items()}
    per_entry = {side: defaultdict(float) for side in runners}
    staged = defaultdict(int)
    for side, runner in runners.items():
        graph = runner.model.pg
        plain_execute = graph.execute

        def execute(entry, _side=side, _plain=plain_execute, _graph=graph, **inputs):
            stager = _graph.callbacks.get(STAGE_EXPERTS)
            before = stager.stats.experts_staged if stager is not None else 0
            t0 = time.thread_time()
            out = _plain(entry, **inputs)
            per_entry[_side][entry] += time.thread_time() - t0
            if stager is not None:
                staged[entry] += stager.stats.experts_staged - before
            return out

        graph.execute = execute
        for r in requests:                             # warm-up: plans built, caches filled
            runner.run(r)
    rows = defaultdict(list)
    for k in range(args.runs):
        for side in (("resident", "offload") if k % 2 == 0 else ("offload", "resident")):
            per_entry[side].clear()
            host[0] = 0.0
            stager = runners[side].model.pg.callbacks.get(STAGE_EXPERTS)
            if stager is not None:
                stager.reset_stats()
            if side == "offload":
                staged.clear()
            t0 = time.thread_time()
            for r in requests:
                runners[side].run(r)
            rows[(side, "total")].append(time.thread_time() - t0)
            for entry, s in per_entry[side].items():
                rows[(side, entry)].append(s)
            if side == "offload":
                rows[("offload", "host steps")].append(host[0])
                rows[("offload", "stager")].append(stager.stats.seconds if stager is not None else 0.0)
                rows[("offload", "copies")].append(stager.stats.copy_seconds if stager is not None else 0.0)
    p10 = {key: float(np.percentile(v, 10)) * 1e3 / args.requests for key, v in rows.items()}
    print(f"ms per request (thread CPU time, p10 of {args.runs} runs of {args.requests} requests)")
    for entry in sorted({e for (_, e) in p10 if e not in ("total", "host steps", "stager", "copies")}) + ["total"]:
        a, b = p10.get(("resident", entry), 0.0), p10.get(("offload", entry), 0.0)
        extra = f", {staged[entry] / args.requests:.1f} experts staged" if entry in staged else ""
        print(f"  {entry:8s} resident {a:7.3f}  offload {b:7.3f}  (+{b - a:6.3f}{extra})")
    print(f"  offload: host steps {p10[('offload', 'host steps')]:.3f} (thread CPU); the stager's own "
          f"StagingStats.seconds {p10[('offload', 'stager')]:.3f}, of which the demand copies "
          f"{p10[('offload', 'copies')]:.3f} (wall time: above the CPU time when the machine is busy)")
    print(f"  offload / resident time: {p10[('offload', 'total')] / p10[('resident', 'total')]:.3f} "
          f"(tokens/s ratio {p10[('resident', 'total')] / p10[('offload', 'total')]:.3f})")
    for runner in runners.values():
        runner.close()


if __name__ == "__main__":
    main()
