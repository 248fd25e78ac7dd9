#!/usr/bin/env python3
"""Piper text-to-speech: Flare's ONNX importer against onnxruntime, side by side in one run.

    python bench/piper_onnx.py [--backends cpu] [--threads 1] [--repeat 2]

Both synthesize the same 10 sentences (espeak-ng phonemes, ids computed once and
shared) with noise scales 0, one thread each (Flare's CPU pool, OMP/OpenBLAS
threads and onnxruntime's intra/inter-op threads set to 1). Reported per runtime: the best
of `--repeat` passes over all 10 sentences, and the largest waveform difference.
The first Flare pass is shown apart as `first`: it traces every sentence and
prepares a plan per segment family and length; later passes replay each
sentence's recorded trace (the same lengths and durations: see the importer's
README, "Replay") and reuse the plans.
Run it on a quiet machine: it is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for part in ("core", "backends", "plugins", "models"):
    sys.path.insert(0, os.path.join(ROOT, part))

SENTENCES = [
    "Hello, world.", "The quick brown fox jumps over the lazy dog.", "It is a lovely day for a walk in the park.",
    "Please call me back when you get this message.", "Flare runs model graphs on many kinds of hardware.",
    "The train to the city leaves at seven o'clock.", "She sells sea shells by the sea shore.",
    "How much wood would a woodchuck chuck?", "Speech synthesis turns written text into sound.",
    "Thank you, and good night!",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import numpy as np
    import onnxruntime as ort

    from flare.core.session import Session, device_list
    from flare.models.onnx.piper.synth import Piper
    from flare.models.onnx.piper.voice import load_voice

    voice = load_voice()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    ref = ort.InferenceSession(str(voice.model_path), opts, providers=["CPUExecutionProvider"])
    scales = np.array([0.0, voice.length_scale, 0.0], np.float32)
    # Flare's CPU kernels run on their own pool (one thread per core unless told): --threads it too
    with Session(device_list(args.backends, "--backends"), config={"cpu": {"threads": args.threads}}) as sess, \
            Piper(sess, voice, noise_scale=0.0, noise_w=0.0) as piper:
        ids = [piper.ids(s) for s in SENTENCES]
        timings = {"flare": [], "onnxruntime": []}
        worst = 0.0
        for _ in range(args.repeat + 1):
            start = time.perf_counter()
            ours = [piper.synthesize_ids(i) for i in ids]
            timings["flare"].append(time.perf_counter() - start)
            start = time.perf_counter()
            theirs = [ref.run(None, {"input": i, "input_lengths": np.array([i.shape[1]], np.int64),
                                     "scales": scales})[0].reshape(-1) for i in ids]
            timings["onnxruntime"].append(time.perf_counter() - start)
            worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)))
        audio = sum(a.size for a in theirs) / voice.sample_rate
    best_f, best_o = min(timings["flare"][1:]), min(timings["onnxruntime"][1:])
    print(f"piper, 10 sentences ({audio:.1f} s of audio), {args.threads} thread(s), flare on {args.backends}")
    print(f"  flare        best {best_f:.3f} s   first (prepares) {timings['flare'][0]:.3f} s")
    print(f"  onnxruntime  best {best_o:.3f} s")
    print(f"  flare / onnxruntime = {best_f / best_o:.2f}x; max |waveform difference| {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
