"""The hand-written NumPy MiniLM peer on its own: agreement and a quick speed figure.

The peer itself lives in the package (`flare.models.minilm.bench_numpy_peer`) so
that `flare bench ... peer = "numpy"` works from an installed wheel; this
script checks it against the float64 oracle (`flare.models.minilm.numpy_reference`)
and against Flare, and times all three on one batch. Not a test; the A B B A
comparison is `flare bench bench/configs/minilm_numpy_b32.toml bench/configs/minilm_flare_b32.toml`.

    python bench/minilm_numpy_peer.py [--batch 32] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from flare.models.minilm.bench_numpy_peer import ERF_SOURCE, MiniLMNumpy
from flare.models.minilm.bench import BUILTIN_SENTENCES
from flare.models.minilm import numpy_reference
from flare.models.minilm.runner import MiniLM
from flare.models.minilm.tokenize import encode, pad_batch
from flare.models.minilm.weights import all_weights
from flare.core.session import Session


def timed(fn, repeats: int) -> tuple[np.ndarray, float]:
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    sentences = [BUILTIN_SENTENCES[i % len(BUILTIN_SENTENCES)] for i in range(args.batch)]
    batch = pad_batch(encode(sentences))
    weights = all_weights()
    peer = MiniLMNumpy(weights)
    ref, ref_s = timed(lambda: numpy_reference.encode(weights, batch.ids, batch.lengths), 1)
    ours, peer_s = timed(lambda: peer.embed(sentences), args.repeats)
    with Session(["cpu"]) as session, MiniLM(session, max_batch=args.batch) as model:
        flare_out, flare_s = timed(lambda: model.embed(sentences), args.repeats)
    n = len(sentences)
    print(f"batch {n}, padded length {batch.ids.shape[1]}; peer erf: {ERF_SOURCE}")
    print(f"peer vs float64 reference: max |diff| {np.abs(ours - ref).max():.2e}")
    print(f"flare vs peer:             max |diff| {np.abs(flare_out - ours).max():.2e}")
    print(f"sentences/s: float64 reference {n / ref_s:.1f}, NumPy peer {n / peer_s:.1f}, flare {n / flare_s:.1f} "
          f"(flare / peer {peer_s / flare_s:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
