"""Benchmark: a Mixtral-style MoE GGUF with experts resident vs staged from the file, A->B->B->A.

Writes (once, into the cache dir) an MoE GGUF with gguf.GGUFWriter — quantized experts,
the layout Mixtral files have — then, per run, loads it fresh (the ledger's peak covers
load and run), prefills and decodes greedily, and records decode tokens/s, peak device
bytes and staging counters. Offload stages the chosen experts from the memory-mapped
file into a bounded cache (`--cache-mb`; default a quarter of the experts), optionally
prefetching the next layer's (`--prefetch N`). Outputs must be identical in every run.
Not a test: run it by hand on a quiet machine, e.g.

    python bench/gguf_moe_offload.py --prefetch 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from flare.core.cache import cache_dir
from flare.core.ledger import LEDGER
from flare.models.gguf.model import GgufLM, Sampling
from flare.models.gguf.testing import TinySpec, write_tiny

SPEC = TinySpec(n_layers=4, d_model=256, n_heads=8, n_kv_heads=2, d_ff=512, n_experts=32, top_k=2, qtype="q4_0",
                seed=7)


def one_run(args: argparse.Namespace, path: str, experts: str) -> dict:
    dev = "cpu:0"
    base = LEDGER.live_bytes(dev)
    LEDGER.reset_peak(dev)
    lm = GgufLM.load(path, experts=experts, cache_mb=args.cache_mb if experts == "offload" else None,
                     prefetch=args.prefetch if experts == "offload" else 0, max_ctx=256, prefill_chunk=4)
    try:
        tok = lm.model.tokenizer()
        prompt = tok.encode("Experts are staged from the file, a few at a time.")[: args.prompt_tokens]
        t0 = time.perf_counter()
        tokens, logits = lm.generate(prompt, args.new_tokens, Sampling(greedy=True), stop_at_eos=False)
        seconds = time.perf_counter() - t0
        staging = lm.stats()["staging"]
    finally:
        lm.release()
    return {"experts": experts, "tokens_per_s": (len(prompt) + len(tokens)) / seconds, "seconds": seconds,
            "peak_bytes": LEDGER.peak_bytes(dev) - base, "tokens": tokens, "logits": np.stack(logits),
            "staging": staging}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--cache-mb", type=float, default=None)
    ap.add_argument("--prefetch", type=int, default=0)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    path = cache_dir("bench", "gguf") / "moe-32x4.gguf"
    if not path.exists():
        write_tiny(path, SPEC)
    runs = []
    for _ in range(args.blocks):
        for experts in ("resident", "offload", "offload", "resident"):
            runs.append(one_run(args, str(path), experts))
    first = runs[0]
    identical = all(r["tokens"] == first["tokens"] and np.array_equal(r["logits"], first["logits"]) for r in runs)
    med = {e: statistics.median(r["seconds"] for r in runs if r["experts"] == e) for e in ("resident", "offload")}
    peak = {e: max(r["peak_bytes"] for r in runs if r["experts"] == e) for e in ("resident", "offload")}
    print(json.dumps({"identical_outputs": identical, "median_seconds": med,
                      "offload_time_ratio": med["offload"] / med["resident"], "peak_bytes": peak,
                      "offload_peak_ratio": peak["offload"] / peak["resident"],
                      "staging": runs[1]["staging"], "prefetch": args.prefetch}, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
