"""What the prefix cache costs when it never hits (not a test): the serving loop in process, cache on and off.

The HTTP pair (`bench/configs/serve_smollm2_unique_cache_{off,on}.toml`) has
per-pair noise of +-15% on a shared machine, far above the 2% it is meant to
show. This drives the one serving loop (`ServeLoop.schedule` / `step`, as
`flare run NAME.core` does) on one runtime with two loops over the same step
engine, one with a prefix cache and one without, and serves the same chat
prompts one at a time (each prompt new: a 0% hit rate), alternating which mode
goes first (each prompt served once untimed before its pair: a prompt's first
use of a program shape costs more, whichever mode it falls to). Per request it takes the thread's CPU seconds (steadier than wall
time under other load), and inside the cache-on requests the seconds spent in
the cache's lookup (`reuse`: hashing included), its store (`store`: hashing,
ledger allocation, the row copies) and the allocation alone. It checks that
both modes ran the same steps (kind, program, tokens) and produced the same
greedy tokens, and that the ledger is back to zero after the runtime is released.

Since both modes run the same steps, the cache's own seconds (lookup + store)
over the cache-off seconds measure its cost with far less noise than the ratio
of the two totals (+-5% between runs under other helpers' load). By default the
timed requests fill a cold cache, so every store copies into fresh memory, whose
first touch costs what the VM makes it cost (`bench/first_touch.py`); `--steady`
fills the cache to its budget first (untimed), so every timed store evicts a
block and reuses its memory: a server that has run a while.

    OPENBLAS_NUM_THREADS=1 python bench/serve_cache_cost.py [--requests 24] [--new-tokens 16] [--steady] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

from summary_json import emit  # bench/, the script's own folder

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

FILLER = " Answer briefly, politely and in plain words, and say so when you do not know."
QUESTIONS = ["Write a short poem about autumn leaves.", "Give three tips for learning to cook.",
             "Why do cats purr?", "Describe a busy market in the morning."]


class Timers:
    """Thread CPU seconds spent inside wrapped callables, by name (the loop is single-threaded)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn: Callable = getattr(owner, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name] += time.thread_time() - t0
                self.calls[name] += 1
        setattr(owner, attr, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24, help="prompts (each served with the cache on and off)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--budget-mib", type=float, default=64.0, help="the cache's byte budget (flare serve's default)")
    ap.add_argument("--block", type=int, default=16, help="tokens per block (flare serve's default)")
    ap.add_argument("--filler", type=int, default=0,
                    help="sentences added to each system message (longer prompts: more blocks per generated token)")
    ap.add_argument("--steady", action="store_true",
                    help="fill the cache to its budget first (untimed): every timed store then takes an evicted "
                         "block's memory, as in a server that has run a while; without it the timed requests "
                         "fill a cold cache (fresh memory on every store)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from flare.core.ledger import LEDGER
    from flare.plugins.export import cached_core, load_core
    from flare.plugins.export.runtime import CoreRuntime
    from flare.plugins.export.serving.sampling import SamplingParams
    from flare.plugins.export.serving.tokenizer import tokenizer_for
    from flare.plugins.serve.engine import StepEngine
    from flare.plugins.serve.loop import Job, ServeLoop, Turns
    from flare.plugins.serve.prefix_cache import PrefixCache

    live0 = LEDGER.live_bytes()
    path = cached_core("smollm2", "smollm2.core")
    core = load_core(path)
    tok = tokenizer_for(path, core.manifest)
    runtime = CoreRuntime(core)
    timers = Timers()
    try:
        engine = StepEngine(runtime)
        cache = PrefixCache(engine, int(args.budget_mib * 2**20), args.block)
        for obj, attr, name in [(cache, "reuse", "lookup"), (cache, "store", "store"), (engine, "_save", "save_block"),
                                (engine, "_drop", "drop_block"), (engine, "run", "steps")]:
            timers.wrap(obj, attr, name)
        for dev in runtime.graph.devices.values():
            timers.wrap(dev, "alloc", "alloc")
        trace: dict[str, list] = {"on": [], "off": []}

        def observer(mode: str) -> Callable:
            return lambda kind, program, plan, logits, decoding: trace[mode].append(
                (kind, program, sum(len(c.tokens) for _, c in plan)))

        loops = {"on": ServeLoop(engine, mixed=core.mixed, prefix_cache=cache, observer=observer("on")),
                 "off": ServeLoop(engine, mixed=core.mixed, observer=observer("off"))}

        def serve(mode: str, prompt: list[int]) -> tuple[list[int], float, float, dict[str, float]]:
            loop = loops[mode]
            st = Turns.empty(engine.serving.max_seqs)
            job = Job("r", tuple(prompt), args.new_tokens, SamplingParams(temperature=0.0), (), lambda ev: None,
                      end_ids=frozenset(tok.end_of_turn))
            st.waiting.append(job)
            timers.take()
            c0, w0 = time.thread_time(), time.perf_counter()
            while st.waiting or st.running:
                loop.schedule(st)
                loop.step(st)
            return list(job.tokens), time.thread_time() - c0, time.perf_counter() - w0, timers.take()

        def prompt_of(i: int) -> list[int]:       # "Call i" first: no two prompts share a block
            system = f"Call {i}. Session {i}. You are a helpful assistant." + FILLER * args.filler
            return tok.chat_prompt([{"role": "system", "content": system},
                                    {"role": "user", "content": f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"}])

        for w in range(2):                          # first-call costs (kernels, buckets) out of the figures
            for mode in ("off", "on"):
                serve(mode, prompt_of(-1 - w - (2 if mode == "on" else 0)))
        filling = 0
        while args.steady and cache.evictions == 0:   # a long-running server's cache: full, every store evicts
            filling += 1
            serve("on", prompt_of(-100 - filling))
        rows = []
        blocks_warm = cache.blocks + cache.evictions
        for i in range(args.requests):
            prompt = prompt_of(i)
            out: dict[str, Any] = {"prompt_tokens": len(prompt)}
            serve("off", prompt)     # the prompt's shapes once untimed: whichever mode came first paid their first use
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                trace[mode].clear()
                tokens, cpu, wall, parts = serve(mode, prompt)
                out[mode] = {"tokens": tokens, "cpu_s": cpu, "wall_s": wall, "parts": parts, "steps": list(trace[mode])}
            rows.append(out)
        same_tokens = all(r["on"]["tokens"] == r["off"]["tokens"] for r in rows)
        same_steps = all(r["on"]["steps"] == r["off"]["steps"] for r in rows)
        stats = cache.stats()
        blocks_stored = stats["blocks"] + stats["evictions"] - blocks_warm
        for loop in loops.values():
            loop.cache = None        # the engine's blocks are freed once, below
        cache.clear()
        engine.close()
    finally:
        runtime.release()
    live = LEDGER.live_bytes() - live0

    def med(mode: str, key: str) -> float:
        return statistics.median(r[mode][key] for r in rows)

    on_cpu, off_cpu = sum(r["on"]["cpu_s"] for r in rows), sum(r["off"]["cpu_s"] for r in rows)
    parts = defaultdict(float)
    for r in rows:
        for k, v in r["on"]["parts"].items():
            parts[k] += v
    summary = {
        "requests": args.requests, "cache state": "steady (full before timing)" if args.steady else "filling (cold)",
        "prompt tokens (median)": statistics.median(r["prompt_tokens"] for r in rows),
        "cpu s per request, cache off (median)": med("off", "cpu_s"),
        "cpu s per request, cache on (median)": med("on", "cpu_s"),
        "cpu total on / off": on_cpu / off_cpu,
        "median of per-request on/off cpu ratios": statistics.median(r["on"]["cpu_s"] / r["off"]["cpu_s"] for r in rows),
        "wall total on / off": sum(r["on"]["wall_s"] for r in rows) / sum(r["off"]["wall_s"] for r in rows),
        "cache's own cpu (lookup + store) / cache-off cpu": (parts["lookup"] + parts["store"]) / off_cpu,
        "cache-on ms per request": {k: 1000 * v / args.requests for k, v in sorted(parts.items())},
        "ms per stored block (store: hashing, index, copies, memory)": 1000 * parts["store"] / max(1, blocks_stored),
        "same greedy tokens": same_tokens, "same steps (kind, program, tokens)": same_steps,
        "cache": stats, "ledger live bytes after release (vs before load)": live,
    }
    emit(summary, rows, args.json)
    return 0 if same_tokens and same_steps else 1


if __name__ == "__main__":
    raise SystemExit(main())
