"""What a prefix-cache block costs to store into fresh memory, by where the memory comes from (not a test).

The cache's store cost at a 0% hit rate is bimodal per process (~0.4 vs ~3 ms
a 720 KiB SmolLM2 block), the slow mode matching the first touch of fresh slab
pages. This separates the candidates in one process, in alternated order:

- the allocator: `CpuDevice.alloc` (np.empty, which NumPy already advises
  MADV_HUGEPAGE from 4 MiB up) against a 2 MiB-aligned anonymous mmap with
  MADV_HUGEPAGE (`_huge_page_backed`, the packed weights' memory);
- the memory's history: pages this process touched and freed a moment ago
  ("hot") against memory freed in bulk (`--freed-mib`) and left idle for
  `--idle` seconds ("idle"). On a VM whose host backs guest memory lazily and
  takes free memory back (free page reporting: this one boots with
  `page_reporting.page_reporting_order=11`), a page the host does not back
  costs a host fault on its first touch, whatever the guest's allocator did;
- fresh against reused: the same slab's blocks copied a second time.

Per slab (`--blocks` copies of `--block-kib`): the thread's CPU seconds and its
minor faults (`getrusage(RUSAGE_THREAD)`). A measurement of the platform, not of Flare's code.

    python bench/first_touch.py [--rounds 4] [--idle 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import mmap
import resource
import statistics
import time
from typing import Any, Callable

import numpy as np

from summary_json import emit  # bench/, the script's own folder


def _kernel_arg(prefix: str) -> str | None:
    try:
        with open("/proc/cmdline") as f:
            return next((a for a in f.read().split() if a.startswith(prefix)), None)
    except OSError:
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _hot_scratch(nbytes: int) -> None:
    """Touch and free `nbytes` of fresh memory: its pages go back to the guest's free lists, still backed."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, np.uint8)
    a[::4096] = 1
    del a
    m.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds left idle before the 'idle' slabs")
    ap.add_argument("--freed-mib", type=int, default=256, help="MiB touched and freed before the idle wait")
    ap.add_argument("--block-kib", type=int, default=720, help="one block's bytes (SmolLM2, 16 tokens, f32 KV)")
    ap.add_argument("--blocks", type=int, default=11, help="blocks per slab (block_memory.SLAB_BYTES)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from flare.backends.cpu.device import CpuDevice, _huge_page_backed

    block = args.block_kib << 10
    slab_bytes = block * args.blocks
    dev = CpuDevice("cpu:first-touch", native=False)
    src = np.random.default_rng(0).integers(0, 255, block, dtype=np.uint8)
    live: list[Any] = []

    def from_device() -> np.ndarray:
        buf = dev.alloc(slab_bytes, tag="first-touch")
        live.append(buf)
        return buf.handle

    def from_mmap() -> np.ndarray:
        raw = _huge_page_backed(slab_bytes, dev.name, dev.memory)
        live.append(raw)
        return raw

    kinds: dict[str, Callable[[], np.ndarray]] = {"device.alloc (np.empty)": from_device,
                                                  "2 MiB-aligned mmap + MADV_HUGEPAGE": from_mmap}

    def copies(raw: np.ndarray) -> tuple[float, int]:
        r0, t0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()
        for i in range(args.blocks):
            raw[i * block: (i + 1) * block] = src
        return 1e3 * (time.thread_time() - t0), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - r0

    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = list(kinds.items())[:: 1 if rnd % 2 == 0 else -1]
        for history in ("idle", "hot"):
            if history == "idle":
                _hot_scratch(args.freed_mib << 20)      # memory the machine freed in bulk, then left idle
                time.sleep(args.idle)
            for name, make in order:
                if history == "hot":
                    _hot_scratch(2 * slab_bytes)
                t0 = time.thread_time()
                raw = make()
                alloc_ms = 1e3 * (time.thread_time() - t0)
                fresh_ms, fresh_faults = copies(raw)
                reused_ms, reused_faults = copies(raw)
                rows.append({"round": rnd, "memory": history, "allocator": name, "alloc_ms": alloc_ms,
                             "fresh_ms": fresh_ms, "fresh_faults": fresh_faults,
                             "reused_ms": reused_ms, "reused_faults": reused_faults})
        for item in live:
            if hasattr(item, "release"):
                item.release()
        live.clear()

    def span(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"

    per_block: dict[str, Any] = {}
    for history in ("idle", "hot"):
        for name in kinds:
            sel = [r for r in rows if r["memory"] == history and r["allocator"] == name]
            per_block[f"{history} memory, {name}"] = {
                "ms per block, first copy (median [range])": span([r["fresh_ms"] / args.blocks for r in sel]),
                "ms per block, copied again": span([r["reused_ms"] / args.blocks for r in sel]),
                "minor faults per slab, first copy": span([r["fresh_faults"] for r in sel]),
                "minor faults per slab, again": span([r["reused_faults"] for r in sel])}
    summary = {"slab": f"{args.blocks} blocks of {args.block_kib} KiB", "rounds": args.rounds, "idle s": args.idle,
               "free page reporting": _kernel_arg("page_reporting."),
               "THP mode": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
               "per block": per_block}
    emit(summary, rows, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
