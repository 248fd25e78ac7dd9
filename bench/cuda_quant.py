"""Flare's CUDA kernels for block-quantized weights, beside the f16 and f32 kernels.

Why: decode is a matrix-vector product whose time is reading the weights, so a 4-bit
weight should be read about 4x faster than an f16 one if the kernel keeps up with the
memory; prefill is a GEMM where dequantizing the weight tile must not cost more than the
product. This times one `matmul(x, w, transpose_b=True)` split per weight dtype on
device-resident operands (replayed as its CUDA graph: `split.run()` = graph launch + stream
synchronize), best of `--repeats` after a warm-up, for `--rows` rows of x (1: decode,
128: a prefill block). Reported: microseconds, the weight bytes read per second (decode's
figure of merit) and GFLOPS, with the kernel the plan chose and the largest error against
the weights dequantized by `gguf.quants` times x in float32, checked before timing.

    python3 bench/cuda_quant.py --n 4096 --k 4096 --rows 1,128 --out cuda-quant.json   # on a GPU
    python3 bench/cuda_quant.py --device emulated --n 64 --k 512 --rows 1,5 --repeats 1   # smoke test
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from flare.core.backend import SplitProgram
from flare.core.dtypes import QUANT_TYPES, block_size, itemsize
from flare.core.graph import GraphBuilder
from flare.core.ops.quant import dequantize_reference

from flare.backends.cuda_emu.devices import bind_graph, open_device

DTYPES = ("f32", "f16", *QUANT_TYPES)


def weights(rng: np.random.Generator, dtype: str, n: int, k: int) -> np.ndarray:
    """[n, k] weights of `dtype` (blocks for the quantized types, scales keeping outputs ~1)."""
    if dtype in QUANT_TYPES:
        import flare.plugins.testing.conformance.cases  # noqa: F401  (before quant_cases: import order)
        from flare.plugins.testing.conformance.quant_cases import quant_blocks

        return quant_blocks(rng, dtype, n, k)
    return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(dtype.replace("f", "float"))


def time_one(dev, dtype: str, w: np.ndarray, wf: np.ndarray, rows: int, repeats: int) -> dict:
    """One weight (`wf`: its float32 values) times `rows` random rows, timed on the device."""
    n, k = wf.shape
    x = np.random.default_rng(rows).uniform(-1.0, 1.0, (rows, k)).astype(np.float32)
    b = GraphBuilder()
    b.output("y", b.matmul(b.input("x", x.shape), b.weight("w", w), transpose_b=True))
    graph = b.build()
    want = (x @ wf.T).astype(np.float64)  # (float32 BLAS: the bench's sanity check, not a conformance test)
    buffers, bindings = bind_graph(dev, graph)
    try:
        dev.write(bindings[graph.inputs["x"].id], x)
        split = dev.compile(SplitProgram(dev, graph.nodes, bindings, {}))
        try:
            split.run()
            got = dev.read(bindings[graph.outputs["y"].id])
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                split.run()
                best = min(best, time.perf_counter() - t0)
            kernels = sorted({launch.kernel for launch in split.plan})
        finally:
            split.release()
    finally:
        for buf in buffers.values():
            buf.release()
    weight_bytes = n * (k // block_size(dtype)) * itemsize(dtype)
    return {"dtype": dtype, "rows": rows, "us": best * 1e6, "weight_gbps": weight_bytes / best / 1e9,
            "gflops": 2.0 * rows * n * k / best / 1e9, "kernels": kernels,
            "max_rel_error": float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("gpu", "emulated"), default="gpu")
    ap.add_argument("--n", type=int, default=4096, help="output features (weight rows)")
    ap.add_argument("--k", type=int, default=4096, help="input features (a multiple of 256)")
    ap.add_argument("--rows", default="1,128", help="rows of x: 1 = decode, 128 = a prefill block")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.k % 256:
        print("error: --k must be a multiple of 256 (the k-quants' super-block)", file=sys.stderr)
        return 2
    dev, why = open_device(args.device)
    if dev is None:
        print(f"cannot run on {args.device}: {why}", file=sys.stderr)
        return 2
    results = []
    try:
        for dtype in (d.strip() for d in args.dtypes.split(",") if d.strip()):
            w = weights(np.random.default_rng(args.n + args.k), dtype, args.n, args.k)
            wf = dequantize_reference(w, dtype) if dtype in QUANT_TYPES else w.astype(np.float32)
            for rows in (int(r) for r in args.rows.split(",") if r.strip()):
                results.append(time_one(dev, dtype, w, wf, rows, args.repeats))
        results.sort(key=lambda r: r["rows"])
        device = dev.describe()
    finally:
        dev.close()
    print(f"matmul(x[rows,{args.k}], w[{args.n},{args.k}]^T) on {device.get('gpu', args.device)} "
          f"(best of {args.repeats})")
    print(f"{'rows':>5} {'dtype':>6} {'us':>10} {'weight GB/s':>12} {'GFLOPS':>9} {'max rel err':>12}  kernel")
    for r in results:
        print(f"{r['rows']:>5} {r['dtype']:>6} {r['us']:>10.1f} {r['weight_gbps']:>12.2f} {r['gflops']:>9.2f} "
              f"{r['max_rel_error']:>12.1e}  {', '.join(r['kernels'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "n": args.n, "k": args.k, "repeats": args.repeats, "rows": results}, f,
                      indent=2, default=str)
    # (8-bit activations in the quantized decode kernels: the conformance suite's QUANT_DOT, 2e-2)
    return 0 if all(r["max_rel_error"] < (2e-2 if r["dtype"] in QUANT_TYPES else 1e-3) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
