"""KV-window benchmark (not a test): SmolLM2 step times with attention over the KV window vs every KV row.

Loads SmolLM2 once (`GgufLM.load("smollm2", max_seqs=4, prefill_chunk=16, max_ctx=512)`:
2,049 KV rows), fills sequence 0 up to each position, then times steps of 1, 4 and
16 tokens of that sequence at that position, alternating the two mask widths in one
process so that load from other work affects both alike: `window` (the bucketed
window `kv_window` picks, what `GgufLM.step` runs) and `full` (the mask over every
KV row, what attention cost before). The logits of the two must be identical;
the script checks that too. Medians of --repeats runs per cell, in ms.
`--seqs K` runs K sequences (slots 0..K-1, each at the position) per step, as a
server with K clients does: the window then reaches slot K-1's rows.

    OPENBLAS_NUM_THREADS=1 python bench/kv_window_steps.py [--positions 40 400] [--repeats 5] [--seqs 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from flare.models.gguf.model import GgufLM, serving_contract
from flare.plugins.export.serving.batch import Chunk, kv_window, token_lm_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, nargs="+", default=[40, 400])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-seqs", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=1, help="sequences per step (slots 0..seqs-1)")
    ap.add_argument("--max-ctx", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the table here too")
    args = ap.parse_args()
    rows = []
    with GgufLM.load("smollm2", devices=[args.device], max_seqs=args.max_seqs, prefill_chunk=16,
                     max_ctx=args.max_ctx) as lm:
        serving = serving_contract(lm.cfg)
        rng = np.random.default_rng(0)
        for position in args.positions:
            lm.reset()
            for seq in range(args.seqs):
                lm.prefill(seq, rng.integers(0, lm.cfg.vocab, position).tolist())
            for size in args.sizes:
                chunks = [Chunk(seq, position, tuple(rng.integers(0, lm.cfg.vocab, size).tolist()))
                          for seq in range(args.seqs)]
                entry = "decode" if size == 1 else "prefill" if args.seqs == 1 else "mixed"
                batch = None if size == 1 else args.seqs
                if entry not in lm.graph.entries:
                    raise SystemExit(f"no entry {entry!r}")
                n = size * args.seqs
                window = kv_window(serving, chunks)
                feeds = {"window": token_lm_inputs(serving, chunks, tokens=n, batch=batch, window=window),
                         "full": token_lm_inputs(serving, chunks, tokens=n, batch=batch)}
                for inputs in feeds.values():         # mixed is prepared on first use (GgufLM.step does so)
                    lm.graph.prepare(entry, {k: v.shape for k, v in inputs.items()})
                times: dict[str, list[float]] = {k: [] for k in feeds}
                logits = {k: lm.graph.execute(entry, **v)["logits"] for k, v in feeds.items()}   # plans, warm-up
                for _ in range(args.repeats):
                    for name, inputs in feeds.items():
                        t0 = time.perf_counter()
                        lm.graph.execute(entry, **inputs)
                        times[name].append(time.perf_counter() - t0)
                med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                same = bool(np.array_equal(logits["window"], logits["full"]))
                rows.append({"position": position, "tokens": size, "seqs": args.seqs, "window": window, "kv_rows": serving.kv_rows,
                             "window_ms": med["window"], "full_ms": med["full"], "speedup": med["full"] / med["window"],
                             "identical_logits": same})
                print(f"pos {position:4d}  {args.seqs} x {size:2d} tokens  window {window:4d}/{serving.kv_rows}: "
                      f"{med['window']:7.2f} ms  full {med['full']:7.2f} ms  x{med['full'] / med['window']:.2f}  "
                      f"identical logits: {same}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
