#!/usr/bin/env python3
"""GPU kernel quality in one run: matmul GFLOPS and model end-to-end times per backend.

1. Matmul: a prepared graph of one `matmul(x, w, transpose_b=True)` (x [n, n] input,
   w [n, n] weight) for each n; the best of `--repeats` executes after one warm-up
   (so kernel compilation and first-use pipeline creation are not timed), as GFLOPS
   = 2 n^3 / seconds. Input upload and output read-back are inside the time, as in
   every `execute`.
2. Recurrence: a prepared graph of one `lstm` node (T steps, batch 1, hidden 128: silero-
   vad's cell) as microseconds per step, best of `--repeats` after one warm-up: the
   sequential part no batching hides (one kernel, one workgroup, on a GPU backend).
3. End to end: `flare run <model> --backends B --json` in a fresh process per backend,
   reporting the `elapsed_s` the CLI measures (compute on a prepared model, not
   process start-up): MiniLM-L6 on its shipped sentences and silero-vad offline on
   its shipped sample. Best of `--e2e-repeats` processes.
4. Quantized weights: the same one-matmul graph with w block-quantized (ggml's q4_0 ...
   q6_k, random blocks with sane scales), for decode (M = 1) and prefill (M = 128) shapes
   of SmolLM2-135M's 576-wide projections (K rounded up to whole blocks); GFLOPS = 2 M K N /
   seconds, best of `--repeats`. Vulkan runs the dequantizing kernels (matvec_q.comp;
   matmul_q_lanes.comp or matmul_q.comp by kernel profile).

Backends are a parameter (`--backends cpu,vulkan,cuda`); one that is not usable here
is reported as such and skipped. Ratios are to the first backend.

    OPENBLAS_NUM_THREADS=1 python bench/gpu_kernels.py [--backends cpu,vulkan] [--sizes 128,256,512]
    python bench/gpu_kernels.py --sizes "" --lstm-steps 0 --models "" --quant-types q4_1,q8_0  # quantized only
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Callable

import numpy as np

MODELS = {"minilm": ["minilm-l6"], "silero-offline": ["silero-vad", "--mode", "offline"]}


def best_seconds(repeats: int, run: Callable[[], object]) -> float:
    """The fastest of `repeats` timed calls of `run` (wall clock)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(backend: str, n: int, repeats: int) -> float:
    """GFLOPS of a prepared one-matmul graph on `backend` (best of `repeats`)."""
    from flare.core.session import Session

    rng = np.random.default_rng(n)
    w = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    x = rng.standard_normal((n, n)).astype(np.float32)

    def build(b, shapes):
        b.output("y", b.matmul(b.input("x", shapes["x"]), b.weight("w", w), transpose_b=True))

    with Session([backend]) as session:
        pg = session.prepare({"full": build}, {"full": {"x": (n, n)}}, strict=True, name=f"matmul{n}")
        got = pg.execute("full", x=x)["y"]
        err = float(np.max(np.abs(got - x @ w.T)))
        if err > 1e-3:
            raise SystemExit(f"{backend}: matmul n={n} is wrong (max abs error {err:.2e})")
        best = best_seconds(repeats, lambda: pg.execute("full", x=x))
    return 2.0 * n**3 / best / 1e9


def lstm_us_per_step(backend: str, steps: int, repeats: int, hidden: int = 128) -> float:
    """Microseconds per step of a prepared one-`lstm` graph (batch 1) on `backend`."""
    from flare.core.ops import OPS
    from flare.core.session import Session

    rng = np.random.default_rng(steps)
    w = (rng.uniform(-1, 1, (4 * hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
    x = rng.uniform(-2, 2, (steps, 1, 4 * hidden)).astype(np.float32)
    h0 = np.zeros((1, hidden), np.float32)

    def build(b, shapes):
        b.output("y", b.lstm(b.input("x", shapes["x"]), b.weight("w", w), b.input("h", (1, hidden)),
                             b.input("c", (1, hidden))))

    with Session([backend]) as session:
        pg = session.prepare({"full": build}, {"full": {"x": x.shape}}, strict=True, name=f"lstm{steps}")
        got = pg.execute("full", x=x, h=h0, c=h0)["y"]
        err = float(np.max(np.abs(got - OPS["lstm"].reference([x, w, h0, h0], {}))))
        if err > 1e-4:
            raise SystemExit(f"{backend}: lstm T={steps} is wrong (max abs error {err:.2e})")
        best = best_seconds(repeats, lambda: pg.execute("full", x=x, h=h0, c=h0))
    return best / steps * 1e6


def quant_gflops(backend: str, dtype: str, shape: tuple[int, int, int], repeats: int) -> float:
    """GFLOPS of a prepared `matmul(x[M, K], w[N, K]^T)` with w in block type `dtype` (best of `repeats`)."""
    from flare.core.dtypes import block_size
    from flare.core.ops.quant import dequantize_reference
    from flare.core.session import Session
    from flare.plugins.testing.conformance import cases  # noqa: F401  (quant_cases imports its helpers from it)
    from flare.plugins.testing.conformance.quant_cases import quant_blocks

    m, k, n = shape
    rng = np.random.default_rng(m + k + n)
    k = -(-k // block_size(dtype)) * block_size(dtype)  # whole blocks (576 -> 768 for the 256-weight k-quants)
    w = quant_blocks(rng, dtype, n, k)
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)

    def build(b, shapes):
        b.output("y", b.matmul(b.input("x", shapes["x"]), b.weight("w", w), transpose_b=True))

    with Session([backend]) as session:
        pg = session.prepare({"full": build}, {"full": {"x": (m, k)}}, strict=True, name=f"qmatmul-{dtype}-{m}")
        got = pg.execute("full", x=x)["y"]
        want = x.astype(np.float64) @ dequantize_reference(w, dtype).astype(np.float64).T
        err = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
        if err > 2e-2:
            raise SystemExit(f"{backend}: {dtype} matmul {shape} is wrong (max relative error {err:.2e})")
        best = best_seconds(repeats, lambda: pg.execute("full", x=x))
    return 2.0 * m * k * n / best / 1e9


def e2e_seconds(backend: str, model: str, repeats: int) -> float:
    """Best `elapsed_s` of `flare run <model> --backends <backend> --json` over fresh processes."""
    cmd = [sys.executable, "-m", "flare.core.cli", "run", *MODELS[model], "--backends", backend, "--json"]
    best = float("inf")
    for _ in range(repeats):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        best = min(best, float(json.loads(proc.stdout)["elapsed_s"]))
    return best


def usable(backend: str) -> tuple[bool, str]:
    from flare.core.session import Session
    try:
        with Session([backend]):
            return True, ""
    except Exception as exc:  # report and skip: an unusable backend is a row, not a crash
        return False, f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="cpu,vulkan", help="comma separated; ratios are to the first")
    ap.add_argument("--sizes", default="128,256,512")
    ap.add_argument("--repeats", type=int, default=5, help="matmul executes timed per size (best kept)")
    ap.add_argument("--lstm-steps", type=int, default=256, help="steps of the lstm recurrence timed (0: none)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"subset of {','.join(MODELS)}; empty for none")
    ap.add_argument("--e2e-repeats", type=int, default=2, help="processes per model and backend (best kept)")
    ap.add_argument("--quant-types", default="q4_0,q4_1,q8_0,q4_k,q6_k", help="block types timed; empty for none")
    ap.add_argument("--quant-shapes", default="1x576x1536,128x576x576", help="MxKxN of the quantized matmuls")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    qtypes = [t.strip() for t in args.quant_types.split(",") if t.strip()]
    qshapes = [tuple(int(d) for d in s.split("x")) for s in args.quant_shapes.split(",") if s.strip()]
    result: dict = {"uptime": _uptime(), "backends": {}, "matmul_gflops": {}, "lstm_us_per_step": {},
                    "quant_gflops": {}, "e2e_s": {}}
    live = []
    for b in backends:
        ok, why = usable(b)
        result["backends"][b] = "usable" if ok else why
        if ok:
            live.append(b)
    for n in sizes:
        result["matmul_gflops"][n] = {b: round(matmul_gflops(b, n, args.repeats), 3) for b in live}
    if args.lstm_steps > 0:
        result["lstm_us_per_step"] = {b: round(lstm_us_per_step(b, args.lstm_steps, args.repeats), 2) for b in live}
    for t in qtypes:
        for shape in qshapes:
            key = f"{t} {'x'.join(map(str, shape))}"
            result["quant_gflops"][key] = {b: round(quant_gflops(b, t, shape, args.repeats), 3) for b in live}
    for m in models:
        result["e2e_s"][m] = {b: e2e_seconds(b, m, args.e2e_repeats) for b in live}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    _print(result, live, sizes, models, args.lstm_steps, bool(qtypes and qshapes))
    return 0


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def _print(result: dict, live: list[str], sizes: list[int], models: list[str], lstm_steps: int, quant: bool) -> None:
    for b, state in result["backends"].items():
        if state != "usable":
            print(f"{b}: skipped ({state})")
    base = live[0] if live else None
    names = "".join(f"{b:>12}" for b in live)
    slower = "".join(f"{b + ' slower':>14}" for b in live[1:])
    print(f"\nmatmul(x[n,n], w[n,n]^T), GFLOPS (best of repeats)\n{'n':>6}{names}{slower}")
    for n in sizes:
        row = result["matmul_gflops"][n]
        print(f"{n:>6}" + "".join(f"{row[b]:>12.3f}" for b in live)
              + "".join(f"{row[base] / row[b]:>13.1f}x" for b in live[1:]))
    if lstm_steps > 0 and live:
        row = result["lstm_us_per_step"]
        print(f"\nlstm recurrence (T={lstm_steps}, B=1, H=128), microseconds per step (best of repeats)\n{'':>6}{names}{slower}")
        print(f"{'':>6}" + "".join(f"{row[b]:>12.2f}" for b in live)
              + "".join(f"{row[b] / row[base]:>13.1f}x" for b in live[1:]))
    if quant and live:
        print(f"\nmatmul(x[M,K], quantized w[N,K]^T), GFLOPS (best of repeats)\n{'type MxKxN':>20}{names}{slower}")
        for key, row in result["quant_gflops"].items():
            print(f"{key:>20}" + "".join(f"{row[b]:>12.3f}" for b in live)
                  + "".join(f"{row[base] / row[b]:>13.1f}x" for b in live[1:]))
    if models:
        print(f"\nend to end, elapsed_s of `flare run ... --json` (best of processes)\n{'model':>16}{names}{slower}")
        for m in models:
            row = result["e2e_s"][m]
            print(f"{m:>16}" + "".join(f"{row[b]:>12.4f}" for b in live)
                  + "".join(f"{row[b] / row[base]:>13.1f}x" for b in live[1:]))
    print(f"\nload when the run started: {result['uptime']}")


if __name__ == "__main__":
    sys.exit(main())
