"""Host memory of a long-lived session: N prepare/release cycles of silero-vad, RSS before and after.

    OPENBLAS_NUM_THREADS=1 python bench/prepare_release_rss.py [--cycles 300] [--backends cpu]

Prints RSS (from /proc/self/statm) after a 10-cycle warm-up and after N cycles, the
growth, and the ledger's live buffers at the end (0 when everything was released).
A resource measurement, not a timing; `tests/test_host_memory.py` asserts the bound on a
small graph.
"""
from __future__ import annotations

import argparse
import gc
import os

import numpy as np


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=300)
    from flare.core.options import add_backends_option

    add_backends_option(ap, dest="backend")
    args = ap.parse_args()
    from flare.core.ledger import LEDGER
    from flare.models.silero_vad.runner import SileroVad
    from flare.core.session import Session

    audio = np.zeros(16000, np.float32)
    with Session(args.backend.split(",")) as sess:
        def cycle() -> None:
            vad = SileroVad(sess)
            vad.speech_probs(audio, "offline")
            vad.release()

        for _ in range(10):
            cycle()
        gc.collect()
        start = rss_mib()
        for _ in range(args.cycles):
            cycle()
        gc.collect()
        end = rss_mib()
        live = len(LEDGER.live_records())
    print(f"silero-vad on {args.backend}: {args.cycles} prepare/execute/release cycles in one session: "
          f"RSS {start:.1f} -> {end:.1f} MiB (growth {end - start:+.1f} MiB); ledger live buffers at the end: {live}")


if __name__ == "__main__":
    main()
