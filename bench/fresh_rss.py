"""Peak resident memory of two bench configurations, each run in a fresh process.

    OPENBLAS_NUM_THREADS=1 python bench/fresh_rss.py A.toml B.toml [--blocks 2]

`flare bench` runs A and B in one process, so a peer whose files stay mapped
(or whose allocator keeps freed pages) from an earlier run looks lighter than
it is in a run of its own; a user starts one process per model. This script
starts one child process per run, in A B B A order: the child imports what
the configuration needs, notes its resident set, opens the configuration,
serves its requests once and closes it, and reports the kernel's peak
(`ru_maxrss`). It prints each run's peak and its growth above the resident
set after imports, the median of each configuration and B/A. A memory
measurement, not a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(path: str) -> None:
    """One run of one configuration in this (fresh) process; prints a JSON line."""
    from flare.plugins.bench.config import check_pair, load_config

    config = load_config(path)
    workload = check_pair(config, config)
    requests = workload.requests(config, workload.default_requests)
    start = _rss_bytes()
    runner = workload.open(config)
    try:
        for request in requests:
            runner.run(request)
    finally:
        runner.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_rss_bytes": peak, "start_rss_bytes": start}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", metavar="CONFIG.toml")
    ap.add_argument("--blocks", type=int, default=2, help="A B B A blocks (default 2)")
    ap.add_argument("--child", metavar="CONFIG.toml", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    if len(args.configs) != 2 or args.blocks < 1:
        ap.error("give two configuration files and --blocks >= 1")
    order = [k for _ in range(args.blocks) for k in "ABBA"]
    peaks: dict[str, list[int]] = {"A": [], "B": []}
    growth: dict[str, list[int]] = {"A": [], "B": []}
    for n, key in enumerate(order, 1):
        path = args.configs[0 if key == "A" else 1]
        done = subprocess.run([sys.executable, __file__, "--child", path], capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr)
            print(f"error: run {n} ({key}: {path}) exited {done.returncode}", file=sys.stderr)
            return 1
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        peaks[key].append(figures["peak_rss_bytes"])
        growth[key].append(figures["peak_rss_bytes"] - figures["start_rss_bytes"])
        print(f"run {n} {key} {os.path.basename(path)}: peak RSS {figures['peak_rss_bytes'] / 2**20:.1f} MiB, "
              f"growth after imports {growth[key][-1] / 2**20:.1f} MiB", flush=True)
    mib = lambda xs: statistics.median(xs) / 2**20  # noqa: E731
    for what, table in (("peak RSS", peaks), ("growth after imports", growth)):
        a, b = mib(table["A"]), mib(table["B"])
        print(f"{what}: A {a:.1f} MiB (range {min(table['A']) / 2**20:.1f}-{max(table['A']) / 2**20:.1f}), "
              f"B {b:.1f} MiB (range {min(table['B']) / 2**20:.1f}-{max(table['B']) / 2**20:.1f}), B/A {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
