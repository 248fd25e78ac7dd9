#!/usr/bin/env python3
"""What the recorded command buffer saves on lavapipe: replay vs re-record vs re-compile.

A ~50-node graph (ten blocks of matmul, tanh, scale, sqr, add on small tensors) is bound
by hand into one arena and compiled to one split. Then each way of executing it runs N
times after a warm-up:
- replay:     `split.run()`: submit the command buffer recorded at compile time;
- re-record:  reset and record the same command buffer again, then submit
              (what every execute costs without capture);
- re-compile: lower, write metadata, allocate descriptor sets and record from scratch
              (a backend that prepares nothing).
Prints mean milliseconds per execute and the ratios to replay.

    python bench/vulkan_capture.py [--runs 200] [--staging]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from flare.core.backend import SplitProgram
from flare.core.graph import GraphBuilder
from flare.backends.vulkan import VulkanBackend
from flare.backends.vulkan.testing import HandBound


def build_graph(blocks: int = 10, rows: int = 8, width: int = 16):
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    h = b.input("x", (rows, width))
    w = b.weight("w", rng.uniform(-0.5, 0.5, (width, width)).astype(np.float32))
    for _ in range(blocks):
        q = b.tanh(b.matmul(h, w))
        h = b.add(b.scale(q, scale=0.5), b.sqr(q))
    b.output("y", h)
    return b.build()


def timed(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--staging", action="store_true", help="force the staging path")
    args = ap.parse_args()
    probe = VulkanBackend.probe()
    if not probe.usable:
        raise SystemExit(f"Vulkan unusable: {probe.reason}")
    (dev,) = VulkanBackend.open_devices({"force_staging": args.staging})
    graph = build_graph()
    hb = HandBound(dev, graph)
    hb.write_leaves({"x": np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)})
    split = hb.compile()
    program = SplitProgram(dev, graph.nodes, hb.bindings)

    def recompile():
        s = dev.compile(program)
        s.run()
        s.release()

    ways = {"replay": split.run, "re-record": split.run_rerecorded, "re-compile": recompile}
    for fn in ways.values():  # warm-up: pipelines compiled, caches hot
        for _ in range(5):
            fn()
    results = {}
    for _ in range(2):  # interleave A,B,C,C,B,A-style to spread drift
        for name in list(ways) + list(ways)[::-1]:
            results.setdefault(name, []).extend(timed(ways[name], max(args.runs // 4, 1)))
    base = statistics.mean(results["replay"])
    print(f"device: {dev.info.summary()}  mapped={dev.mapped}")
    print(f"graph: {len(graph.nodes)} nodes, {split.stats['dispatches']} dispatches, {split.stats['barriers']} barriers")
    for name, samples in results.items():
        mean = statistics.mean(samples)
        print(f"{name:>10}: {mean * 1e3:8.3f} ms/execute (median {statistics.median(samples) * 1e3:.3f}, "
              f"n={len(samples)})  ratio to replay {mean / base:5.2f}x")
    hb.release()
    dev.close()


if __name__ == "__main__":
    main()
