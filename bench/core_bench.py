"""Core benchmarks (not tests), issue 2.

1. Planned arena bytes vs the liveness lower bound vs one buffer per tensor,
   for a BERT-like transformer encoder graph (goal: planned <= 1.05x bound).
2. Time per execute of a prepared graph vs building, planning and executing
   on every call, for a graph of ~200 small nodes (goal: prepared >= 5x faster).

    python bench/core_bench.py [--layers 4] [--seq 64] [--repeats 200]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from flare.core.session import Session


def encoder_builder(layers: int, hidden: int, heads: int, ffn: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = {}
    for l in range(layers):
        for name, shape in (("qkv", (3 * hidden, hidden)), ("o", (hidden, hidden)),
                            ("up", (ffn, hidden)), ("down", (hidden, ffn))):
            w[f"L{l}.{name}"] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    dh = hidden // heads

    def build(b, shapes):
        x = b.input("x", shapes["x"])
        mask = b.input("mask", shapes["mask"])
        t = shapes["x"][0]
        for l in range(layers):
            qkv = b.matmul(x, b.weight(f"L{l}.qkv", w[f"L{l}.qkv"]), transpose_b=True)
            q = b.permute(b.reshape(b.slice(qkv, axis=1, start=0, stop=hidden), shape=(t, heads, dh)), axes=(1, 0, 2))
            k = b.permute(b.reshape(b.slice(qkv, axis=1, start=hidden, stop=2 * hidden), shape=(t, heads, dh)), axes=(1, 0, 2))
            v = b.permute(b.reshape(b.slice(qkv, axis=1, start=2 * hidden, stop=3 * hidden), shape=(t, heads, dh)), axes=(1, 0, 2))
            att = b.softmax(b.matmul(q, k, transpose_b=True), mask, scale=1 / np.sqrt(dh))
            ctx = b.reshape(b.permute(b.matmul(att, v), axes=(1, 0, 2)), shape=(t, hidden))
            x = b.layer_norm(b.add(x, b.matmul(ctx, b.weight(f"L{l}.o", w[f"L{l}.o"]), transpose_b=True)))
            h = b.gelu(b.matmul(x, b.weight(f"L{l}.up", w[f"L{l}.up"]), transpose_b=True))
            x = b.layer_norm(b.add(x, b.matmul(h, b.weight(f"L{l}.down", w[f"L{l}.down"]), transpose_b=True)))
        b.output("y", x)
    return build


def small_chain(n_nodes: int):
    """~n_nodes tiny elementwise/matmul nodes: framework overhead dominates."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 8)).astype(np.float32) / 3

    def build(b, shapes):
        x = b.input("x", shapes["x"])
        for i in range(n_nodes // 4):
            h = b.matmul(x, b.weight("w", w))
            x = b.add(b.tanh(h), b.scale(x, scale=0.5))
        b.output("y", x)
    return build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()

    hidden, heads, ffn = 384, 12, 1536
    shapes = {"x": (args.seq, hidden), "mask": (1, 1, args.seq)}
    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": encoder_builder(args.layers, hidden, heads, ffn)}, {"full": shapes})
        arena = pg.describe()["entries"]["full"]["arena"]["cpu:0"]
        nodes = pg.describe()["entries"]["full"]["nodes"]
        print(f"transformer encoder: {args.layers} layers, seq {args.seq}, hidden {hidden}, {nodes} nodes")
        print(f"  planned arena        {arena['planned'] / 2**20:8.2f} MiB  ({arena['inplace']} in-place reuses)")
        print(f"  liveness lower bound {arena['lower_bound'] / 2**20:8.2f} MiB")
        print(f"  one buffer / tensor  {arena['naive'] / 2**20:8.2f} MiB")
        print(f"  planned / lower bound = {arena['planned'] / arena['lower_bound']:.3f} (goal <= 1.05); "
              f"naive / planned = {arena['naive'] / arena['planned']:.1f}x")

        build = small_chain(200)
        x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
        chain = sess.prepare({"full": build}, {"full": {"x": x.shape}})
        n = chain.describe()["entries"]["full"]["nodes"]
        chain.execute("full", x=x)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            chain.execute("full", x=x)
        prepared = (time.perf_counter() - t0) / args.repeats
        t0 = time.perf_counter()
        reps = max(10, args.repeats // 10)
        for _ in range(reps):
            g = sess.prepare({"full": build}, {"full": {"x": x.shape}})
            g.execute("full", x=x)
            g.release()
        rebuilt = (time.perf_counter() - t0) / reps
        print(f"graph of {n} small nodes: prepared execute {prepared * 1e6:.0f} us, "
              f"build+plan+execute every call {rebuilt * 1e6:.0f} us -> prepared is {rebuilt / prepared:.1f}x faster (goal >= 5x)")


if __name__ == "__main__":
    main()
