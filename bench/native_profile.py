"""Where a native CPU command list's time goes, command by command, and what of it a second thread can share.

Issue 24's scaling goals (MiniLM batch 32 at 2 threads >= 1.8x one thread, moe-lm decode >= 1.7x)
are set by the part of a step that runs on one thread: commands below the split thresholds
(`plan()` in kernels.c), mul_mat_id's grouping, the hand-over between steps. This runs each
command of the workload's last command list alone on one thread (`flare_run` of one record,
median of `--reps`), asks kernels.c how it would run on `--threads` threads
(`flare_cmd_mode`), and prints the time by kind, split or not, and the slowest commands. The
sum of the serial part plus the split part divided by the threads is the list's floor at that
thread count (before hand-overs and the pool's wake-up).

    OPENBLAS_NUM_THREADS=1 python bench/native_profile.py minilm --batch 32
    OPENBLAS_NUM_THREADS=1 python bench/native_profile.py moe --size small [--cold]
    OPENBLAS_NUM_THREADS=1 python bench/native_profile.py moe --size mid --entry prefill [--cold]
"""
from __future__ import annotations

import argparse
import collections
import os
import time
from typing import Any, Callable

import numpy as np


_KEEP: list[Any] = []


def _command_lists(plan: Any) -> list[Any]:
    from flare.backends.cpu.split import CommandList

    found: list[Any] = []
    for prog in plan.programs:
        for step in getattr(prog, "_steps", []) if prog is not None else []:
            if isinstance(step, CommandList) and all(step is not f for f in found):
                found.append(step)
    return found


def _moe(args: argparse.Namespace) -> tuple[Any, Callable[[], None]]:
    from flare.core import Session
    from flare.models.moe_lm import MoeLM, encode

    session = Session(["cpu"])
    model = MoeLM.load(args.size, experts="resident", session=session)
    model.prefill(0, encode("hello world")[:4])
    model.decode([0], [5], [40])
    if args.entry == "prefill":   # a 4-token chunk, as the bench's 48-token prompts are prefilled
        model.prefill(0, [7, 8, 9, 10], start=36)
    plan = model.graph.current_plan(args.entry)
    _KEEP.append((session, model))
    views = {name: view for name, _dev, _binding, view in plan.input_writes}
    rng = np.random.default_rng(0)

    def before() -> None:  # cold: a random token each pass (random experts), as in real text
        views["tokens"][...] = rng.integers(0, 256, views["tokens"].shape) if args.cold else 7
    return plan, before


def _minilm(args: argparse.Namespace) -> tuple[Any, Callable[[], None]]:
    from flare.core import Session
    from flare.models.minilm.bench import BUILTIN_SENTENCES
    from flare.models.minilm.runner import MiniLM

    session = Session(["cpu"])
    model = MiniLM(session, max_batch=args.batch, max_length=256)
    sentences = [BUILTIN_SENTENCES[j % len(BUILTIN_SENTENCES)] for j in range(args.batch)]
    model.embed(sentences)
    graph = model.pg
    entry = "embed" if args.batch == 1 else "embed_packed"   # what MiniLM.embed_tokens runs
    plan = graph.current_plan(entry)
    _KEEP.append((session, model))  # released with the model otherwise
    return plan, lambda: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=("moe", "minilm"))
    ap.add_argument("--size", default="small", help="moe-lm size")
    ap.add_argument("--cold", action="store_true", help="moe-lm: a random token each pass")
    ap.add_argument("--entry", default="decode", choices=("decode", "prefill"),
                    help="moe-lm: the entry whose command list is timed (prefill: a 4-token chunk)")
    ap.add_argument("--batch", type=int, default=32, help="MiniLM sentences")
    ap.add_argument("--threads", type=int, default=2, help="the thread count to plan for")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    os.environ["FLARE_CPU_THREADS"] = "1"
    from flare.backends.cpu.lowering import KINDS

    plan, before = (_moe if args.workload == "moe" else _minilm)(args)
    lists = _command_lists(plan)
    times: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
    for _ in range(args.reps):
        before()
        for li, cl in enumerate(lists):
            for i in range(cl._n):
                t = time.perf_counter_ns()
                cl._lib.flare_run(cl._arr + i, 1, cl._err)
                times[(li, i)].append((time.perf_counter_ns() - t) / 1e3)
    from flare.backends.cpu.native import load
    ffi = load().ffi
    wp = ffi.new("int64_t *")
    rows = []
    for li, cl in enumerate(lists):
        for i in range(cl._n):
            mode = int(cl._lib.flare_cmd_mode(cl._arr + i, args.threads, wp))
            rows.append((float(np.median(times[(li, i)])), KINDS[cl._arr[i].kind], mode == 2, cl._names[i],
                         [int(cl._arr[i].ne[j]) for j in range(4)]))
    split = sum(r[0] for r in rows if r[2])
    serial = sum(r[0] for r in rows if not r[2])
    print(f"{len(rows)} commands in {len(lists)} list(s); one thread: {split + serial:.0f} us "
          f"(each command alone: includes ~1 us of call per command); split at {args.threads} threads: {split:.0f} us "
          f"in {sum(r[2] for r in rows)} commands, serial: {serial:.0f} us; floor at {args.threads} threads "
          f"{serial + split / args.threads:.0f} us ({(split + serial) / (serial + split / args.threads):.2f}x)")
    by: dict[tuple[str, bool], list[float]] = collections.defaultdict(list)
    for r in rows:
        by[(r[1], r[2])].append(r[0])
    print("by kind (us, commands):")
    for (kind, is_split), v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {kind:14s} {'split ' if is_split else 'serial'} {sum(v):9.1f} {len(v):4d}")
    print(f"slowest {args.top} serial commands:")
    for r in sorted((r for r in rows if not r[2]), reverse=True)[:args.top]:
        print(f"  {r[0]:8.1f} {r[1]:12s} {r[3][:48]:48s} {r[4]}")


if __name__ == "__main__":
    main()
