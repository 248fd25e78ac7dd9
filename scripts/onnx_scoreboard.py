#!/usr/bin/env python3
"""ONNX backend scoreboard: pass / fail / skip of ONNX's backend test suite, per category.

    python scripts/onnx_scoreboard.py --backend cpu            # Flare on the CPU
    python scripts/onnx_scoreboard.py --backend vulkan         # Flare on vulkan (CPU for what vulkan lacks)
    python scripts/onnx_scoreboard.py --backend onnxruntime    # the same script over onnxruntime.backend

Every test of `onnx.backend.test.BackendTest` is run (the exclusions file is
*not* applied: excluded tests count as failures here), with the suite's own
comparison and tolerances. "real" tests download their models and are
counted as skipped on a machine without network. Besides the scoreboard's
categories the table shows the "fp32-class" node tests: graph inputs and
outputs float32 / int64 / int32 / bool, default domain, `_expanded` included.
`--failures FILE` writes each failing test with its first error line;
`--write-exclusions` (cpu) rewrites models/flare/models/onnx/backend_test_exclusions.txt
from the failures, grouped by reason (suite.exclusion_reason).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for part in ("core", "backends", "plugins", "models"):
    path = os.path.join(ROOT, part)
    if path not in sys.path:
        sys.path.insert(0, path)


def backend_class(name: str):
    if name == "onnxruntime":
        import onnxruntime
        import onnxruntime.backend as ort_backend

        onnxruntime.set_default_logger_severity(4)  # its warnings about old opsets would drown the table

        return ort_backend
    from flare.models.onnx.backend import FlareBackend

    devices = [d.strip() for d in name.split(",") if d.strip()]
    if devices[-1].split(":")[0] != "cpu":
        devices.append("cpu")  # ops a GPU backend lacks run on the CPU (the scheduler places them)
    return FlareBackend.for_devices(devices)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cpu", help="cpu, vulkan, cuda (Flare devices) or onnxruntime")
    p.add_argument("-k", default="", help="only tests whose name contains this")
    p.add_argument("--json", action="store_true")
    p.add_argument("--failures", default=None, metavar="FILE")
    p.add_argument("--write-exclusions", action="store_true",
                   help="rewrite the exclusions file from this run's failures (whole suite, cpu only)")
    args = p.parse_args(argv)

    import warnings

    warnings.simplefilter("ignore")
    from flare.models.onnx import suite

    cls = backend_class(args.backend)
    bt = suite.build(cls)
    tally: dict[str, Counter] = {}
    failures = []
    start = time.perf_counter()
    for item in suite.items(bt):
        if args.k and args.k not in item.name:
            continue
        if item.kind == "real":
            status, detail = "skipped", "downloads its model (no network here)"
        else:
            status, detail = suite.outcome(bt, item)
        for group in [item.kind] + (["node fp32-class"] if item.fp32_class else []):
            tally.setdefault(group, Counter())[status] += 1
        if status == "failed":
            failures.append((item.name, detail))
    seconds = time.perf_counter() - start
    if hasattr(cls, "close"):
        cls.close()
    order = ["node", "node fp32-class", "simple", "pytorch-converted", "pytorch-operator", "real"]
    rows = {g: dict(tally.get(g, Counter())) for g in order}
    total = Counter()
    for g in ("node", "simple", "pytorch-converted", "pytorch-operator", "real"):
        total.update(tally.get(g, Counter()))
    rows["total"] = dict(total)
    if args.failures:
        with open(args.failures, "w") as f:
            for name, detail in failures:
                f.write(f"{name}\t{detail}\n")
    if args.write_exclusions:
        if args.k or args.backend != "cpu":
            p.error("--write-exclusions needs the whole suite on cpu (no -k)")
        suite.write_exclusions(failures)
    if args.json:
        print(json.dumps({"backend": args.backend, "seconds": round(seconds, 1), "categories": rows}, indent=2))
        return 0
    print(f"ONNX backend scoreboard: {args.backend} ({seconds:.0f} s)")
    print(f"{'category':<20} {'passed':>7} {'failed':>7} {'skipped':>8} {'total':>7}")
    for g, c in rows.items():
        n = sum(c.values())
        print(f"{g:<20} {c.get('passed', 0):>7} {c.get('failed', 0):>7} {c.get('skipped', 0):>8} {n:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
