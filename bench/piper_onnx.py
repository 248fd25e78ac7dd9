#!/usr/bin/env python3
"""Piper text-to-speech: Flare's ONNX importer against onnxruntime, side by side in one run.

    python bench/piper_onnx.py [--backends cpu] [--threads 1] [--repeat 2]

Both synthesize the same 10 sentences (espeak-ng phonemes, ids computed once and
shared) with noise scales 0, one thread each (Flare's CPU pool, OMP/OpenBLAS
threads and onnxruntime's intra/inter-op threads set to 1), taking turns sentence by
sentence (each call timed alone, summed per runtime and pass), so that a slow spell of a
shared host falls on both. Reported per runtime: the best
of `--repeat` passes over all 10 sentences, and the largest waveform difference; wall time,
and the process's CPU time on a line of its own (one thread each: the steadier figure on a
shared machine, where wall time also counts the waits for a core).
Two passes are shown apart: the first (cold: Flare folds the file's constants,
uploads weights, traces every sentence and prepares a plan per segment family and
length bucket), and one over 10 NEW sentences on the warm runner (what synthesizing
new text costs: a sentence whose padded length was seen replays that bucket's
encoder and duration predictor and resumes the trace at its durations, walking and
planning only the decoder; a new bucket is traced whole). Later passes replay each
sentence's recorded trace (the same lengths and durations: see the importer's
README, "Replay") and reuse the plans. Flare gets the ids padded to its length
bucket (piper.synth), onnxruntime the ids as they are.
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
# ten more, never synthesized before they are timed (after SENTENCES warmed the runner): what a
# user synthesizing new text pays once the model is loaded (a trace and plans per new length)
NEW_SENTENCES = [
    "Where did you put the keys to the car?", "A cup of tea would be nice right now.",
    "Our meeting moved to Thursday afternoon.", "The museum opens at nine in the morning.",
    "Rain is expected later this week, so bring an umbrella.", "Can you hear the birds singing outside?",
    "He wrote a long letter to his grandmother.", "Turn left at the second traffic light.",
    "Numbers and dates are read aloud as words.", "That was the best concert I have ever seen!",
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
        new_ids = [piper.ids(s) for s in NEW_SENTENCES]
        timings = {"flare": [], "onnxruntime": []}
        cpu = {"flare": [], "onnxruntime": []}   # process CPU time: steadier than wall time on a shared machine
        worst = 0.0

        def ort_call(i: np.ndarray) -> np.ndarray:
            return ref.run(None, {"input": i, "input_lengths": np.array([i.shape[1]], np.int64),
                                  "scales": scales})[0].reshape(-1)

        calls = {"flare": piper.synthesize_ids, "onnxruntime": ort_call}

        def both(batch: list) -> list:
            """One pass over `batch`, the runtimes taking turns sentence by sentence (who goes
            first alternating), each call timed on its own: a slow spell of the machine (other
            VMs on the host) then falls on both runtimes' sums alike, not on whichever was
            running its 10 sentences then."""
            nonlocal worst
            wall = {k: 0.0 for k in calls}
            proc = {k: 0.0 for k in calls}
            outs: dict = {k: [] for k in calls}
            for n, i in enumerate(batch):
                for name in (("flare", "onnxruntime") if n % 2 == 0 else ("onnxruntime", "flare")):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    outs[name].append(calls[name](i))
                    wall[name] += time.perf_counter() - start
                    proc[name] += time.process_time() - start_cpu
            for name in calls:
                timings[name].append(wall[name])
                cpu[name].append(proc[name])
            ours, theirs = outs["flare"], outs["onnxruntime"]
            worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)))
            return theirs

        both(ids)                       # pass 0: cold (loads, folds the file's constants, traces)
        theirs_new = both(new_ids)      # pass 1: new sentences on a warm runner
        for _ in range(args.repeat):
            theirs = both(ids)          # later passes: sentences seen before (replayed)
        audio = sum(a.size for a in theirs) / voice.sample_rate
        audio_new = sum(a.size for a in theirs_new) / voice.sample_rate
    f, o = timings["flare"], timings["onnxruntime"]
    best_f, best_o = min(f[2:]), min(o[2:])
    print(f"piper, 10 sentences ({audio:.1f} s of audio), {args.threads} thread(s), flare on {args.backends}")
    print(f"  seen before:  flare best {best_f:.3f} s   onnxruntime best {best_o:.3f} s   "
          f"flare / onnxruntime = {best_f / best_o:.2f}x")
    print(f"  new sentences ({audio_new:.1f} s of audio, warm runner): flare {f[1]:.3f} s   onnxruntime {o[1]:.3f} s   "
          f"= {f[1] / o[1]:.2f}x")
    print(f"  first pass (cold: loads, traces, prepares): flare {f[0]:.3f} s   onnxruntime {o[0]:.3f} s   "
          f"= {f[0] / o[0]:.2f}x")
    fc, oc = cpu["flare"], cpu["onnxruntime"]
    print(f"  CPU time (process): seen flare {min(fc[2:]):.3f} s / onnxruntime {min(oc[2:]):.3f} s = "
          f"{min(fc[2:]) / min(oc[2:]):.2f}x;  new {fc[1]:.3f} / {oc[1]:.3f} s = {fc[1] / oc[1]:.2f}x;  "
          f"cold {fc[0]:.3f} / {oc[0]:.3f} s = {fc[0] / oc[0]:.2f}x")
    print(f"  max |waveform difference| {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
