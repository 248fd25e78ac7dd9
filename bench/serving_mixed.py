"""Serving benchmark (not a test): one exported moe-lm core, mixed prefill on vs off, A->B->B->A.

A concurrent workload (requests arriving at a steady rate, prompts of
different lengths) is served by the continuous-batching scheduler on the
same core loaded twice: with mixed programs (`--mixed-prefill`) and without
(`--no-mixed-prefill`). Reported per configuration (median of its runs):
time to first token (mean, p95), tokens/s, program launches (total and per
request), steps by kind, memory (persistent, workspace arenas, ledger peak,
process RSS) and what selection kept. Generated tokens of the two
configurations are compared.

    python bench/serving_mixed.py [--size small] [--requests 16] [--new-tokens 16] [--gap 0.02]
                                  [--core PATH] [--blocks 1] [--json bench/results/serving_mixed.json]

BLAS threads default to 1 (OPENBLAS_NUM_THREADS): on a shared 2-core machine
OpenBLAS's threaded path for 8-row matmuls ran 50-100x slower than the
single-threaded one once the model's weights were resident (measured while
writing this script), which would measure the machine, not the scheduler.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--blas-threads" not in sys.argv:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

def workload(n: int, new_tokens: int, gap: float):
    """The same concurrent requests `flare bench`'s moe-lm-serving workload serves."""
    from flare.models.moe_lm.bench_serving import concurrent_requests

    return concurrent_requests(n, new_tokens, gap)


def run_once(core_path: Path, mixed: bool, requests) -> dict:
    from flare.plugins.export import LoadOptions, load_core
    from flare.plugins.export.runtime import CoreRuntime
    from flare.core.ledger import LEDGER
    from flare.plugins.export.serving import Engine
    from flare.plugins.serve.offline import Batcher

    t0 = time.perf_counter()
    core = load_core(core_path, LoadOptions(mixed_prefill=mixed))
    LEDGER.reset_peak()
    with CoreRuntime(core) as rt:
        load_s = time.perf_counter() - t0
        report = Batcher(Engine(rt)).run(list(requests))
        report["memory"] = rt.memory()
        report["launches_by_program"] = dict(rt.launches)
    report["load_s"] = load_s
    report["selection"] = {"programs": len(core.programs), "kernels": len(core.kernels), "tuning": len(core.tuning),
                           "pruned_tuning": list(core.selection.pruned_tuning)}
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=["tiny", "mid", "small"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--gap", type=float, default=0.02, help="seconds between request arrivals")
    p.add_argument("--core", type=Path, default=None, help="an exported core (default: export one under bench/results)")
    p.add_argument("--blocks", type=int, default=1, help="A B B A blocks")
    p.add_argument("--blas-threads", type=int, default=None, help="leave BLAS threading as the environment says")
    p.add_argument("--json", type=Path, default=Path("bench/results/serving_mixed.json"))
    args = p.parse_args()

    from flare.plugins.export import export_core

    core = args.core or Path(f"bench/results/moe-{args.size}.core")
    if not core.exists():
        export_core("moe-lm", core, options={"size": args.size}, progress=True)
    requests = workload(args.requests, args.new_tokens, args.gap)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.blocks):
        for label in ("on", "off", "off", "on"):
            r = run_once(core, label == "on", requests)
            runs[label].append(r)
            print(f"  mixed {label:3}: {r['seconds']:.3f} s, {r['tokens_per_s']:.1f} tokens/s, "
                  f"ttft mean {1000 * r['ttft_s']['mean']:.1f} ms, launches {r['launches']}", file=sys.stderr)

    def med(label: str, fn) -> float:
        return float(np.median([fn(r) for r in runs[label]]))

    rows = [
        ("tokens/s", lambda r: r["tokens_per_s"], "{:.1f}"),
        ("time to first token, mean (ms)", lambda r: 1000 * r["ttft_s"]["mean"], "{:.1f}"),
        ("time to first token, p95 (ms)", lambda r: 1000 * r["ttft_s"]["p95"], "{:.1f}"),
        ("wall time (s)", lambda r: r["seconds"], "{:.3f}"),
        ("program launches (total)", lambda r: r["launches"], "{:.0f}"),
        ("launches per request (mean)", lambda r: r["launches_per_request"]["mean"], "{:.1f}"),
        ("prefill / decode / mixed steps", None, None),
        ("persistent bytes (weights, KV, inputs)", lambda r: sum(m["persistent_bytes"] for m in r["memory"].values()),
         "{:,.0f}"),
        ("workspace arena bytes", lambda r: sum(m["workspace_bytes"] for m in r["memory"].values()), "{:,.0f}"),
        ("ledger peak bytes", lambda r: sum(m["peak_bytes"] for m in r["memory"].values()), "{:,.0f}"),
        ("programs / kernels / tuning entries kept", None, None),
    ]
    print(f"\nmoe-lm {args.size}: {args.requests} requests, {args.new_tokens} new tokens each, one every "
          f"{args.gap * 1000:.0f} ms; median of {2 * args.blocks} runs per configuration (A B B A)\n")
    print(f"| {'':42} | mixed on | mixed off |\n|---|---:|---:|")
    for name, fn, fmt in rows:
        if name.startswith("prefill"):
            cells = ["/".join(str(runs[l][0]["steps"][k]) for k in ("prefill", "decode", "mixed")) for l in ("on", "off")]
        elif name.startswith("programs"):
            cells = [f"{s['programs']} / {s['kernels']} / {s['tuning']}" for s in (runs[l][0]["selection"] for l in ("on", "off"))]
        else:
            cells = [fmt.format(med(l, fn)) for l in ("on", "off")]
        print(f"| {name:42} | {cells[0]} | {cells[1]} |")
    same = [a["tokens"] == b["tokens"] for a, b in zip(runs["on"][0]["per_request"], runs["off"][0]["per_request"])]
    print(f"\nidentical generated tokens (on vs off): {sum(same)}/{len(same)} requests; "
          f"logits sha256 on {runs['on'][0]['logits_sha256'][:12]} / off {runs['off'][0]['logits_sha256'][:12]}")
    print(f"process max RSS {max(r['max_rss_bytes'] for rs in runs.values() for r in rs) / 2**20:.0f} MiB; "
          f"BLAS threads {os.environ.get('OPENBLAS_NUM_THREADS', 'default')}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
