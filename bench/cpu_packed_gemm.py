"""CPU native matmul routes on MiniLM's linear shapes (a benchmark, not a test).

For each (rows M, weight [N, K]) the same prepared one-matmul graph runs with
the weight pre-packed (route R_PACKED, the default for constant weights) and
with pre-packing off (the earlier routes: wdot up to 16 rows, OpenBLAS
(W a^T)^T up to 64, sgemm beyond). Prints the median time per call and GFLOP/s.

    OPENBLAS_NUM_THREADS=1 python bench/cpu_packed_gemm.py [--rows 1 8 14 24 64 448] [--repeats 200]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from flare.backends.cpu.native import commands
from flare.core.session import Session

SHAPES = ((384, 384), (1536, 384), (384, 1536))  # Q/K/V/output, intermediate, output.dense


def time_matmul(m: int, n: int, k: int, packed: bool, repeats: int) -> float:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)

    def entry(b, shapes):
        b.output("y", b.matmul(b.input("x", (m, k)), b.weight("w", w), transpose_b=True))

    saved = commands.PACKED_MAX_ROWS
    commands.PACKED_MAX_ROWS = saved if packed else 0
    try:
        with Session(["cpu"]) as sess:
            pg = sess.prepare({"f": entry}, {"f": {"x": (m, k)}})
            for _ in range(5):
                pg.execute("f", x=x)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                pg.execute("f", x=x)
                times.append(time.perf_counter() - t0)
            pg.release()
    finally:
        commands.PACKED_MAX_ROWS = saved
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 14, 24, 64, 448])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    print(f"{'M':>5} {'N':>5} {'K':>5} {'packed us':>10} {'GFLOP/s':>8} {'earlier us':>11} {'GFLOP/s':>8} {'speedup':>8}")
    for m in args.rows:
        for n, k in SHAPES:
            tp = time_matmul(m, n, k, True, args.repeats)
            to = time_matmul(m, n, k, False, args.repeats)
            g = 2 * m * n * k / 1e9
            print(f"{m:5d} {n:5d} {k:5d} {tp * 1e6:10.1f} {g / tp:8.1f} {to * 1e6:11.1f} {g / to:8.1f} {to / tp:7.2f}x")


if __name__ == "__main__":
    main()
