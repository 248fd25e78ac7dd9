"""Flare's CUDA matmul kernels beside the device's cuBLAS, in GFLOPS.

Why: `bench/gpu_kernels.py` times whole `execute` calls (uploads and read-backs
included), which on a GPU hides the kernel. This times only the kernels: a split
of one `matmul(x, w, transpose_b=True)` (the layout of every linear layer) on
device-resident operands, replayed as its CUDA graph (`split.run()` = graph launch
+ stream synchronize), best of `--repeats` after a warm-up; with `--variants`
also every kernel variant a tuning profile may choose (`CudaDevice.kernel_variants`).
(Export-time tuning times whole executes; this isolates the kernels.) Beside it, the same
f32 product through cuBLAS, by the first binding found:

- nvmath-python (`nvmath.linalg.advanced.matmul`, cuBLASLt), else
- CuPy (`cupy.matmul`, cuBLAS sgemm; TF32 stays off unless CUPY_TF32=1),

timed with CUDA events around `--repeats` products. Neither installed: the
cuBLAS column says why and is skipped. Every Flare result is checked against
NumPy (max relative error printed) before it is timed.

    python3 bench/cuda_matmul.py --sizes 256,1024,4096 --variants --out cuda-matmul.json   # on a GPU
    python3 bench/cuda_matmul.py --device emulated --sizes 33,64 --repeats 1    # smoke test, no GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from flare.core.backend import SplitProgram
from flare.core.graph import GraphBuilder

from flare.backends.cuda import lowering

from flare.backends.cuda_emu.devices import bind_graph, open_device


def time_variants(dev, graph, inputs, names, repeats):
    """(best seconds per variant name, the first variant's outputs): one-node splits replayed
    on device-resident operands; "auto" is the untuned plan."""
    op = graph.nodes[-1].op
    buffers, bindings = bind_graph(dev, graph)
    try:
        for name, arr in inputs.items():
            dev.write(bindings[graph.inputs[name].id], arr)
        seconds, outputs = {}, None
        for variant in names:
            split = dev.compile(SplitProgram(dev, graph.nodes, bindings, {op: variant}))
            try:
                split.run()
                if outputs is None:
                    outputs = {n: dev.read(bindings[t.id]) for n, t in graph.outputs.items()}
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    split.run()
                    best = min(best, time.perf_counter() - t0)
                seconds[variant] = best
            finally:
                split.release()
        return seconds, outputs
    finally:
        for buf in buffers.values():
            buf.release()


def flare_matmul(dev, n: int, repeats: int, variants: bool) -> dict:
    """GFLOPS of Flare's kernels for an [n,n] x [n,n]^T product, operands on the device:
    the default plan, and with `variants` every tuning variant too."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, n)).astype(np.float32)
    w = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    b = GraphBuilder()
    b.output("y", b.matmul(b.input("x", (n, n)), b.weight("w", w), transpose_b=True))
    names = dev.kernel_variants("matmul") if variants else ("auto",)
    seconds, outputs = time_variants(dev, b.build(), {"x": x}, names, repeats)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    rel = float(np.abs(outputs["y"] - want).max() / max(np.abs(want).max(), 1e-30))
    kernel = lowering.matmul_plan(n, n, n, True, 1, n, "f32", None)[1]
    flops = 2.0 * n**3
    return {"gflops": flops / seconds["auto"] / 1e9, "seconds": seconds["auto"], "max_rel_error": rel,
            "kernel": kernel, "variants_gflops": {v: flops / s / 1e9 for v, s in seconds.items() if v != "auto"}}


def cublas_matmul(n: int, repeats: int) -> dict:
    """GFLOPS of cuBLAS for the same product, or {"skipped": why}."""
    try:
        import cupy as cp
    except Exception as exc:  # nvmath-python also works on CuPy arrays here
        return {"skipped": f"neither CuPy nor a CUDA array library to hold operands ({type(exc).__name__}: {exc})"}
    rng = np.random.default_rng(n)
    x = cp.asarray(rng.standard_normal((n, n)).astype(np.float32))
    w = cp.asarray((rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32))
    try:
        import nvmath

        def product():
            return nvmath.linalg.advanced.matmul(x, w.T)
        binding = f"nvmath-python {getattr(nvmath, '__version__', '?')} (cuBLASLt)"
    except Exception:
        def product():
            return cp.matmul(x, w.T)
        binding = f"CuPy {cp.__version__} (cuBLAS)"
    product()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    best = float("inf")
    for _ in range(repeats):
        start.record()
        product()
        stop.record()
        stop.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return {"gflops": 2.0 * n**3 / best / 1e9, "seconds": best, "binding": binding}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("gpu", "emulated"), default="gpu")
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--variants", action="store_true", help="also time every tile variant (tuning)")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    dev, why = open_device(args.device)
    if dev is None:
        print(f"cannot run on {args.device}: {why}", file=sys.stderr)
        return 2
    rows = []
    try:
        for n in sizes:
            row = {"n": n, "flare": flare_matmul(dev, n, args.repeats, args.variants)}
            row["cublas"] = cublas_matmul(n, args.repeats) if args.device == "gpu" else {"skipped": "emulated"}
            rows.append(row)
        device = dev.describe()
    finally:
        dev.close()
    print(f"matmul(x[n,n], w[n,n]^T) f32 on {device.get('gpu', args.device)}, GFLOPS (best of {args.repeats})")
    print(f"{'n':>6} {'flare':>10} {'cublas':>10} {'flare/cublas':>13}  flare max rel err")
    for r in rows:
        f, c = r["flare"], r["cublas"]
        cg = c.get("gflops")
        cublas = "-" if cg is None else f"{cg:.2f}"
        ratio = "-" if cg is None else f"{f['gflops'] / cg:.1%}"
        variants = "  ".join(f"{v} {g:.2f}" for v, g in f["variants_gflops"].items())
        print(f"{r['n']:>6} {f['gflops']:>10.2f} {cublas:>10} {ratio:>13}  {f['max_rel_error']:.1e}"
              f"  ({f['kernel']}{'; ' + variants if variants else ''})")
    skipped = {r["cublas"]["skipped"] for r in rows if "skipped" in r["cublas"]}
    for why in skipped:
        print(f"cuBLAS skipped: {why}")
    result = {"device": device, "repeats": args.repeats, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0 if all(r["flare"]["max_rel_error"] < 1e-4 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
