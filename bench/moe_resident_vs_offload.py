"""Benchmark: moe-lm with experts resident vs offloaded, in A->B->B->A order.

Each run loads the model fresh (so the ledger's peak covers load and run),
serves the same requests (prefill + greedy decode), and records tokens/s,
peak device bytes and staging counters. A->B->B->A cancels slow drift (page
cache warm-up, a busy neighbour); the time ratio compares medians; outputs must be bitwise identical in every
run. Not a test: run it by hand, e.g.

    python bench/moe_resident_vs_offload.py --size small
    python bench/moe_resident_vs_offload.py --size small --backends vulkan
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from flare.core.ledger import LEDGER
from flare.models.moe_lm import MoeLM, encode, get_config
from flare.models.moe_lm import weights as moe_weights

PROMPTS = [
    "Mixture-of-experts models route every token to a few experts out of many.",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "Offloading keeps the experts on disk and copies the chosen ones per step.",
]


def one_run(args: argparse.Namespace, experts: str, devices: list[str]) -> dict:
    dev = devices[0] if ":" in devices[0] else f"{devices[0]}:0"
    baseline = LEDGER.live_bytes(dev)
    LEDGER.reset_peak(dev)
    t0 = time.perf_counter()
    model = MoeLM.load(args.size, experts=experts, cache_mb=args.cache_mb, devices=devices,
                       expert_source=args.expert_source, prefetch=args.prefetch if experts == "offload" else 0)
    load_s = time.perf_counter() - t0
    outputs = []
    try:
        model.generate(encode("warm up"), 2)  # plans for both entries built outside the timing
        if model.stager is not None:
            model.stager.reset_stats()
        prefill_s = decode_s = 0.0
        prefill_tok = decode_tok = 0
        for prompt in PROMPTS[: args.requests]:
            ids = encode(prompt)[: args.prompt_tokens]
            t0 = time.perf_counter()
            logits = model.prefill(0, ids)
            prefill_s += time.perf_counter() - t0
            prefill_tok += len(ids)
            out, steps = [], [logits]
            tok = int(np.argmax(logits))
            t0 = time.perf_counter()
            for j in range(args.new_tokens - 1):
                out.append(tok)
                logits = model.decode([0], [tok], [len(ids) + j])[0]
                steps.append(logits)
                tok = int(np.argmax(logits))
            decode_s += time.perf_counter() - t0
            decode_tok += args.new_tokens - 1
            out.append(tok)
            outputs.append((out, np.stack(steps)))
        stats = model.stats()
    finally:
        model.release()
    total_s = prefill_s + decode_s
    return {
        "experts": experts, "load_s": load_s, "prefill_tok_s": prefill_tok / prefill_s,
        "decode_tok_s": decode_tok / decode_s, "total_s": total_s, "tok_s": (prefill_tok + decode_tok) / total_s,
        "peak_bytes": LEDGER.peak_bytes(dev) - baseline, "staging": stats["staging"],
        "slots": stats["slots_per_layer"], "outputs": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small")
    from flare.core.options import add_backends_option

    add_backends_option(p, dest="backend", help="first device (cpu is appended as fallback)")
    p.add_argument("--cache-mb", type=float, default=None, help="offload cache MiB (default: the size's default)")
    p.add_argument("--expert-source", choices=["mmap", "host"], default="mmap")
    p.add_argument("--prefetch", type=int, default=0,
                   help="offload: guess this many experts per token of the next layer, copy in the background")
    p.add_argument("--rounds", type=int, default=1, help="repeat the A->B->B->A sequence (medians are reported)")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    devices = [args.backend] + ([] if args.backend == "cpu" else ["cpu"])
    cfg = get_config(args.size)
    path = moe_weights.ensure(cfg)  # generate once, outside the timings
    print(f"moe-lm {args.size}: {cfg.n_layers} layers, {cfg.n_experts} experts (top-{cfg.top_k}), "
          f"{cfg.expert_total_bytes / 2**20:.0f} MiB of experts in {path}", flush=True)
    runs = []
    for experts in ("resident", "offload", "offload", "resident") * args.rounds:
        r = one_run(args, experts, devices)
        runs.append(r)
        st = r["staging"]
        extra = (f" slots {r['slots']}/{cfg.n_experts} hit {st['hit_rate']:.2f} staged {st['experts_staged']} "
                 f"({st['bytes_staged'] / 2**20:.0f} MiB, {st['copies']} copies, {st['seconds']:.2f} s)"
                 + (f" prefetched {st['prefetched']} (used {st['prefetch_hits']}, waited {st['prefetch_wait_seconds']:.2f} s)"
                    if args.prefetch else "") if st else "")
        print(f"{experts:9s} load {r['load_s']:.2f}s prefill {r['prefill_tok_s']:.1f} tok/s decode "
              f"{r['decode_tok_s']:.1f} tok/s total {r['total_s']:.2f}s peak {r['peak_bytes'] / 2**20:.1f} MiB{extra}",
              flush=True)
    ref = runs[0]["outputs"]
    identical = all(o[0] == r[0] and np.array_equal(o[1], r[1]) for run in runs for o, r in zip(run["outputs"], ref))
    res = [r for r in runs if r["experts"] == "resident"]
    off = [r for r in runs if r["experts"] == "offload"]
    time_ratio = statistics.median(r["total_s"] for r in off) / statistics.median(r["total_s"] for r in res)
    mem_ratio = max(r["peak_bytes"] for r in off) / min(r["peak_bytes"] for r in res)
    print(f"offload/resident over {len(runs)} runs: median time {time_ratio:.2f}x (goal <= 1.5x), peak memory {mem_ratio:.1%} (goal <= 30%), "
          f"outputs identical: {identical}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "time_ratio": time_ratio, "mem_ratio": mem_ratio, "identical": identical,
                       "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}, fh, indent=2)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
