"""`flare run NAME.core`: a list of requests served to completion by the one serving loop, greedy.

There is one continuous-batching loop (`loop.ServeLoop`, policy in `policy.py`);
`flare serve` runs it on its own thread behind HTTP, and `Batcher` drives the
very same `schedule` and `step` turn by turn in the calling thread, releasing
each request at its `arrival` (seconds after the start; the clock and sleep
are injectable for tests). Requests that cannot fit the core (prompt plus new
tokens past the context, ids outside the vocabulary or special) are rejected,
not fatal. Greedy decoding (argmax, never a token the contract forbids) makes
runs reproducible, which the multi-rank test relies on. The report is
`serving.metrics.summarize`'s: per request (tokens, time to first token from
its arrival, launches it took part in, steps by kind), totals, and the sha256
of every step's logits.
"""
from __future__ import annotations

import hashlib
import time
from collections import deque
from typing import Any, Callable

import numpy as np

from flare.plugins.export.serving.engine import Engine
from flare.plugins.export.serving.metrics import RequestStats, summarize
from flare.plugins.export.serving.requests import Request, prompt_ids_problem
from flare.plugins.export.serving.sampling import SamplingParams

from .loop import Job, ServeLoop, Turns

Clock = Callable[[], float]
GREEDY = SamplingParams(temperature=0.0)


class Batcher:
    """Serve a list of requests to completion on `engine` (see the module docstring)."""

    def __init__(self, engine: Engine, *, use_mixed: bool | None = None, clock: Clock = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, on_token: Callable[[str, int], None] | None = None,
                 bos: int | None = None):
        self.engine = engine
        self.bos = bos              # the tokenizer's <bos>, the one special id a prompt may hold (None: 256)
        self.serving = engine.serving
        self.use_mixed = engine.has("mixed") if use_mixed is None else (use_mixed and engine.has("mixed"))
        self.clock = clock
        self.sleep = sleep
        self.on_token = on_token
        self.steps: dict[str, int] = {"prefill": 0, "decode": 0, "mixed": 0}
        self.trace: list[tuple[str, str, int, int]] = []   # (kind, program, tokens, sequences decoding) per step
        self._logits_hash = hashlib.sha256()

    def run(self, requests: list[Request]) -> dict[str, Any]:
        """Serve every request; returns the report (see `serving.metrics.summarize`)."""
        stats: dict[str, RequestStats] = {}
        rejected: dict[str, str] = {}
        start = self.clock()

        def observe(kind: str, program: str, plan: list, logits: np.ndarray, decoding: int) -> None:
            self._logits_hash.update(np.ascontiguousarray(logits, np.float32).tobytes())
            self.steps[kind] += 1
            self.trace.append((kind, program, sum(len(c.tokens) for _, c in plan), decoding))
            t = self.clock() - start
            for s, _ in plan:
                st = stats[s.job.id]
                st.launches += 1
                st.steps[kind] = st.steps.get(kind, 0) + 1
                if s.job.tokens and st.first_token is None:
                    st.first_token = t
                if s.job.finish_reason is not None:
                    st.finished = t
                    st.tokens = list(s.job.tokens)

        loop = ServeLoop(self.engine, mixed=self.use_mixed, observer=observe)  # type: ignore[arg-type]
        turns = Turns.empty(self.serving.max_seqs)
        pending = deque(sorted(requests, key=lambda r: r.arrival))
        try:
            while pending or turns.waiting or turns.running:
                now = self.clock() - start
                while pending and pending[0].arrival <= now:
                    r = pending.popleft()
                    why = self._reject(r)
                    if why:
                        rejected[r.id] = why
                        continue
                    stats[r.id] = RequestStats(r.id, len(r.prompt), r.arrival, admitted=now)
                    turns.waiting.append(Job(r.id, r.prompt, r.max_new_tokens, GREEDY, (), self._sink(r.id)))
                loop.schedule(turns)
                if not loop.step(turns) and pending:
                    self.sleep(max(0.0, pending[0].arrival - (self.clock() - start)))
        finally:
            self.engine.stop()
        makespan = self.clock() - start
        return summarize(list(stats.values()), makespan, dict(self.steps), rejected, self._logits_hash.hexdigest())

    def _sink(self, rid: str) -> Callable[[dict[str, Any]], None]:
        def sink(ev: dict[str, Any]) -> None:
            if self.on_token is not None and "token" in ev:
                self.on_token(rid, ev["token"])
        return sink

    def _reject(self, r: Request) -> str | None:
        sv = self.serving
        if len(r.prompt) + r.max_new_tokens - 1 > sv.max_ctx:
            return f"prompt of {len(r.prompt)} + {r.max_new_tokens} new tokens exceeds the context of {sv.max_ctx}"
        return prompt_ids_problem(r.prompt, sv) if self.bos is None else prompt_ids_problem(r.prompt, sv, self.bos)
