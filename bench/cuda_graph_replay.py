"""CUDA graph replay vs plain kernel launches, for a ~50-node graph.

Why: a split replays as one CUDA graph (`CudaGraphSplit.run`) instead of one
`cuLaunchKernel` per node from Python. This measures what that buys on a
launch-bound graph (small tensors, many nodes): wall time per execution,
both ending with a stream synchronize, and checks both give identical
outputs that match the NumPy reference.

    python3 bench/cuda_graph_replay.py --out results.json          # on a GPU
    python3 bench/cuda_graph_replay.py --device emulated --iters 3  # smoke test, no GPU
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

from flare.core.backend import SplitProgram
from flare.core.graph import GraphBuilder
from flare.core.reference import evaluate

from flare.backends.cuda.driver import call
from flare.backends.cuda.split import CudaGraphSplit
from flare.backends.cuda_emu.devices import bind_graph, open_device


def build(blocks: int, rows: int, dim: int):
    """`blocks` x 5 nodes: matmul, add bias, gelu, layer_norm, residual add."""
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    x = b.input("x", (rows, dim))
    h = x
    for i in range(blocks):
        w = b.weight(f"w{i}", (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32))
        bias = b.weight(f"b{i}", rng.standard_normal(dim).astype(np.float32) * 0.1)
        y = b.layer_norm(b.gelu(b.add(b.matmul(h, w), bias)))
        h = b.add(h, y)
    b.output("y", h)
    return b.build()


def timed(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("gpu", "emulated"), default="gpu")
    ap.add_argument("--blocks", type=int, default=10, help="5 nodes per block (default 10 -> 50 nodes)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.device == "emulated":  # keep the host emulation quick
        args.rows, args.dim = min(args.rows, 4), min(args.dim, 16)

    dev, why = open_device(args.device)
    if dev is None:
        print(f"cannot run on {args.device}: {why}", file=sys.stderr)
        return 2
    graph = build(args.blocks, args.rows, args.dim)
    buffers, bindings = bind_graph(dev, graph)
    try:
        x = np.random.default_rng(1).standard_normal((args.rows, args.dim)).astype(np.float32)
        dev.write(bindings[graph.inputs["x"].id], x)
        out = bindings[graph.outputs["y"].id]
        split = dev.compile(SplitProgram(dev, graph.nodes, bindings))
        functions = [dev.function(l.module, l.kernel) for l in split.plan]

        def plain() -> None:
            CudaGraphSplit._launch_all(dev.driver, split.plan, functions, dev.stream)
            call(dev.driver.cuStreamSynchronize(dev.stream), "cuStreamSynchronize")

        for _ in range(args.warmup):
            split.run()
            plain()
        plain()
        y_plain = dev.read(out)
        split.run()
        y_graph = dev.read(out)
        want = evaluate(graph, {"x": x})[0]["y"]
        graph_us = timed(split.run, args.iters)
        plain_us = timed(plain, args.iters)
        result = {
            "device": dev.describe(),
            "nodes": len(graph.nodes),
            "launches": len(split.plan),
            "shape": [args.rows, args.dim],
            "iters": args.iters,
            "graph_replay_us": {"median": statistics.median(graph_us), "min": min(graph_us)},
            "plain_launches_us": {"median": statistics.median(plain_us), "min": min(plain_us)},
            "speedup_median": statistics.median(plain_us) / statistics.median(graph_us),
            "outputs_identical": bool(np.array_equal(y_plain, y_graph)),
            "max_abs_error_vs_reference": float(np.abs(y_graph - want).max()),
            "python": platform.python_version(),
        }
        split.release()
    finally:
        for buf in buffers.values():
            buf.release()
        dev.close()
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    ok = result["outputs_identical"] and result["max_abs_error_vs_reference"] < 1e-3
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
