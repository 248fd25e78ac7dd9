"""One step of serving: pick the smallest program of a kind that fits, pad, run, return logits.

The engine knows buckets, not policy: the scheduler decides *what* runs
(a prefill chunk, decode tokens, or both in a mixed step); the engine maps
that to a captured program and its fixed-shape inputs. Under MPI, rank 0's
engine broadcasts every step (as JSON) before running it and the other
ranks' engines replay it (`follow`), so all ranks launch the same programs
with the same inputs — the expert-parallel all-reduce inside the programs
needs exactly that.

Programs whose graph declares the dim `window` (mask axis 1: the KV rows the
attention reads) get a mask of the step's bucketed window (`kv_window`) instead
of every KV row; the core's loader replays the program at that width, a plan
per width kept (`window_sizes` of them at most).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from flare.core.errors import InputError

from .batch import MIN_WINDOW, Chunk, kv_window, token_lm_inputs

WINDOW_DIM = ["mask", 1]     # how a token-lm/1 program declares its KV window (flare.core.graph.Dim)


def windowed_programs(core: Any) -> frozenset[str]:
    """Programs of a loaded core that take a mask narrower than every KV row."""
    graphs = getattr(core, "graphs", {}) or {}
    return frozenset(n for n, g in graphs.items() if isinstance(g, dict)
                     and (g.get("dims") or {}).get("window") == WINDOW_DIM)


def window_sizes(kv_rows: int) -> int:
    """How many window buckets (`kv_window`) a cache of `kv_rows` rows has: powers of two from
    MIN_WINDOW below kv_rows, and kv_rows itself."""
    n, w = 1, MIN_WINDOW
    while w < kv_rows:
        n, w = n + 1, w * 2
    return n


class Executor(Protocol):
    """What runs programs (CoreRuntime): the loaded core and execute-by-name."""

    core: Any

    def execute(self, program: str, **inputs: np.ndarray) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class Bucket:
    program: str
    kind: str
    tokens: int
    batch: int


class Engine:
    """Runs steps on the selected programs of a loaded core."""

    def __init__(self, runtime: Executor, comm: Any = None):
        self.runtime = runtime
        self.comm = comm
        self.serving = runtime.core.manifest.serving
        self.buckets: dict[str, list[Bucket]] = {"prefill": [], "decode": [], "mixed": []}
        for name, p in runtime.core.programs.items():
            self.buckets.setdefault(p.kind, []).append(Bucket(name, p.kind, p.bucket.tokens, p.bucket.batch))
        for v in self.buckets.values():
            v.sort(key=lambda b: (b.tokens, b.batch))
        self.windowed = windowed_programs(runtime.core)
        graph = getattr(runtime, "graph", None)
        if self.windowed and graph is not None:       # a plan per window bucket, none evicted
            graph.max_plans = max(graph.max_plans, window_sizes(self.serving.kv_rows) + 1)
        self.steps = 0

    @property
    def mixed(self) -> bool:
        return bool(self.buckets["mixed"])

    def has(self, kind: str) -> bool:
        return bool(self.buckets.get(kind))

    def limit(self, kind: str) -> tuple[int, int]:
        """(most tokens, most sequences) one step of `kind` can hold; (0, 0) if the core has none."""
        bs = self.buckets.get(kind, [])
        return (max(b.tokens for b in bs), max(b.batch for b in bs)) if bs else (0, 0)

    def bucket(self, kind: str, tokens: int, seqs: int) -> Bucket:
        for b in self.buckets[kind]:
            if b.tokens >= tokens and b.batch >= seqs:
                return b
        raise InputError(f"no {kind} program holds {tokens} tokens of {seqs} sequences "
                         f"(buckets: {[(b.tokens, b.batch) for b in self.buckets[kind]]})")

    def window(self, b: Bucket, chunks: Sequence[Chunk]) -> int | None:
        """The mask width of a step on program `b`: the step's KV window, or None (every row)."""
        return kv_window(self.serving, chunks) if b.program in self.windowed else None

    def run(self, kind: str, chunks: Sequence[Chunk]) -> tuple[np.ndarray, Bucket]:
        """Logits [len(chunks), vocab] of each chunk's last token, and the program that ran."""
        if self.comm is not None and self.comm.Get_size() > 1:
            from flare.plugins.export.ranks import bcast_json
            bcast_json(self.comm, {"kind": kind, "chunks": [c.to_list() for c in chunks]})
        return self._run(kind, chunks)

    def _run(self, kind: str, chunks: Sequence[Chunk]) -> tuple[np.ndarray, Bucket]:
        n = sum(len(c.tokens) for c in chunks)
        b = self.bucket(kind, n, len(chunks))
        inputs = token_lm_inputs(self.serving, chunks, tokens=b.tokens, batch=None if kind == "decode" else b.batch,
                                 window=self.window(b, chunks))
        logits = self.runtime.execute(b.program, **inputs)["logits"]
        self.steps += 1
        return logits[: len(chunks)], b   # decode: a row per token = per sequence; others: out_rows

    def stop(self) -> None:
        """Rank 0: tell followers the run is over."""
        if self.comm is not None and self.comm.Get_size() > 1:
            from flare.plugins.export.ranks import bcast_json
            bcast_json(self.comm, {"stop": True})

    def follow(self) -> int:
        """Ranks > 0: replay rank 0's steps until it stops; returns the number of steps."""
        from flare.plugins.export.ranks import bcast_json

        while True:
            msg = bcast_json(self.comm, None)
            if msg.get("stop"):
                return self.steps
            self._run(msg["kind"], [Chunk.from_list(c) for c in msg["chunks"]])
