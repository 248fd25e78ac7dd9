"""Continuous batching: admit requests into free sequence slots and run one program per step.

Each step is one of:
- `mixed`: one sequence's prefill chunk plus one decode token of every
  sequence already decoding (when the core has mixed programs);
- `prefill`: a chunk of the oldest sequence still reading its prompt;
- `decode`: one token of every decoding sequence.

Without mixed programs, prefill and decode steps alternate whenever both
have work, so neither starves: a prompt advances by at least one chunk every
other step and every decoding sequence gets a token every other step.
Prompts are served oldest first. Finished sequences free their slot at once
(their KV rows need no reset: the mask never admits rows a request did not
write). Greedy decoding (argmax, never a token the contract forbids) makes
runs reproducible, which the multi-rank test relies on.
"""
from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, TypeVar

import numpy as np

from .batch import Chunk
from .sampling import SamplingParams, TokenChooser
from .engine import Engine
from .metrics import RequestStats, summarize
from .requests import Request, prompt_ids_problem

Clock = Callable[[], float]


@dataclass
class _Seq:
    req: Request
    slot: int
    stats: RequestStats
    fed: int = 0                                  # prompt tokens already in the KV cache
    tokens: list[int] = field(default_factory=list)
    served: int = -1                              # last step that fed this sequence

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.req.prompt)

    @property
    def position(self) -> int:
        """Position of the next token fed to the model."""
        return self.fed + max(0, len(self.tokens) - 1)


class Planned(Protocol):
    """What the step policy reads of a sequence (the batcher's and `flare serve`'s)."""

    slot: int
    fed: int                      # prompt tokens already in the KV cache
    served: int                   # the last step that fed it
    tokens: list[int]

    @property
    def req(self) -> Any: ...     # has `.prompt`
    @property
    def prefilling(self) -> bool: ...
    @property
    def position(self) -> int: ...


S = TypeVar("S", bound=Planned)


def plan_step(engine: Engine, running: Sequence[S], last: str | None, use_mixed: bool) -> tuple[str, list[tuple[S, Chunk]]]:
    """The next step: its kind and a chunk for each sequence it feeds (see the module docstring)."""
    prefilling = [s for s in running if s.prefilling]
    # least recently served first: when a step cannot hold every decoding sequence, none starves
    decoding = sorted((s for s in running if not s.prefilling), key=lambda s: s.served)
    cap = engine.serving.max_prefill_tokens
    if use_mixed and prefilling and decoding:
        t_max, b_max = engine.limit("mixed")
        dec = decoding[: b_max - 1]
        p = prefilling[0]
        n = min(len(p.req.prompt) - p.fed, cap, t_max - len(dec))
        return "mixed", [(p, _prefill_chunk(p, n))] + [(s, _decode_chunk(s)) for s in dec]
    if prefilling and (not decoding or last != "prefill"):
        p = prefilling[0]
        n = min(len(p.req.prompt) - p.fed, cap, engine.limit("prefill")[0])
        return "prefill", [(p, _prefill_chunk(p, n))]
    t_max, b_max = engine.limit("decode")
    return "decode", [(s, _decode_chunk(s)) for s in decoding[: min(t_max, b_max)]]


def _prefill_chunk(s: Planned, n: int) -> Chunk:
    return Chunk(s.slot, s.fed, tuple(s.req.prompt[s.fed: s.fed + n]))


def _decode_chunk(s: Planned) -> Chunk:
    return Chunk(s.slot, s.position, (s.tokens[-1],))


class Batcher:
    """Serve a list of requests to completion on `engine`; see the module docstring."""

    def __init__(self, engine: Engine, *, use_mixed: bool | None = None, clock: Clock = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, on_token: Callable[[str, int], None] | None = None):
        self.engine = engine
        self.serving = engine.serving
        self.use_mixed = engine.mixed if use_mixed is None else (use_mixed and engine.mixed)
        self.clock = clock
        self.sleep = sleep
        self.on_token = on_token
        self.steps: dict[str, int] = {"prefill": 0, "decode": 0, "mixed": 0}
        self.trace: list[tuple[str, str, int, int]] = []   # (kind, program, tokens, sequences decoding) per step
        self._logits_hash = hashlib.sha256()
        self._greedy = TokenChooser(SamplingParams(temperature=0.0), self.serving.never)

    # ----------------------------------------------------------------- policy
    def _plan(self, running: list[_Seq], last: str | None) -> tuple[str, list[tuple[_Seq, Chunk]]]:
        return plan_step(self.engine, running, last, self.use_mixed)

    def _sample(self, logits: np.ndarray) -> int:
        return self._greedy(logits)

    # -------------------------------------------------------------------- run
    def run(self, requests: list[Request]) -> dict[str, Any]:
        """Serve every request; returns the report (see `metrics.summarize`)."""
        sv = self.serving
        start = self.clock()
        pending = deque(sorted(requests, key=lambda r: r.arrival))
        waiting: deque[Request] = deque()
        free = list(range(sv.max_seqs))
        running: list[_Seq] = []
        stats: dict[str, RequestStats] = {}
        rejected: dict[str, str] = {}
        last: str | None = None
        while pending or waiting or running:
            now = self.clock() - start
            while pending and pending[0].arrival <= now:
                waiting.append(pending.popleft())
            while waiting and free:
                r = waiting.popleft()
                why = self._reject(r)
                if why:
                    rejected[r.id] = why
                    continue
                st = RequestStats(r.id, len(r.prompt), r.arrival, admitted=now)
                stats[r.id] = st
                running.append(_Seq(r, free.pop(0), st))
            if not running:
                if pending:
                    self.sleep(max(0.0, pending[0].arrival - (self.clock() - start)))
                continue
            kind, plan = self._plan(running, last)
            logits, bucket = self.engine.run(kind, [c for _, c in plan])
            self._logits_hash.update(np.ascontiguousarray(logits, np.float32).tobytes())
            self.steps[kind] += 1
            self.trace.append((kind, bucket.program, sum(len(c.tokens) for _, c in plan),
                               sum(1 for s in running if not s.prefilling)))
            last = kind
            t = self.clock() - start
            for (s, chunk), row in zip(plan, logits):
                s.served = len(self.trace)
                s.stats.launches += 1
                s.stats.steps[kind] = s.stats.steps.get(kind, 0) + 1
                if s.prefilling:
                    s.fed += len(chunk.tokens)
                    if s.prefilling:
                        continue              # more prompt to read: these logits are not used
                tok = self._sample(row)
                s.tokens.append(tok)
                if s.stats.first_token is None:
                    s.stats.first_token = t
                if self.on_token is not None:
                    self.on_token(s.req.id, tok)
            for s in list(running):
                if s.tokens and (len(s.tokens) >= s.req.max_new_tokens or s.tokens[-1] == sv.eos):
                    s.stats.finished = t
                    s.stats.tokens = list(s.tokens)
                    running.remove(s)
                    free.append(s.slot)
                    free.sort()
        makespan = self.clock() - start
        self.engine.stop()
        return summarize(list(stats.values()), makespan, dict(self.steps), rejected,
                         self._logits_hash.hexdigest())

    def _reject(self, r: Request) -> str | None:
        sv = self.serving
        if len(r.prompt) + r.max_new_tokens - 1 > sv.max_ctx:
            return f"prompt of {len(r.prompt)} + {r.max_new_tokens} new tokens exceeds the context of {sv.max_ctx}"
        return prompt_ids_problem(r.prompt, sv)
