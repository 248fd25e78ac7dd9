"""The one serving loop: continuous batching over the core's sequence slots (a thread for `flare serve`,
driven turn by turn for `flare run NAME.core`: `offline.py`).

The HTTP side only `submit`s and `cancel`s; this thread owns the runtime and
is the only one that touches it. Each turn it takes new requests (waiting
ones beyond `max_queue` were refused at submit with `QueueFull`), drops
cancelled ones, admits waiting requests into free slots (copying any cached
prefix into the slot's KV rows), then runs one step:
- `mixed` (a prefill chunk of the oldest prompt plus a decode token of every
  decoding sequence) when the core's mixed programs are selected;
- otherwise `prefill` and decode alternate whenever both have work: the
  policy is `policy.plan_step`, so neither starves and
  greedy tokens are the same;
- a decode turn is a speculative round (up to K proposals from prompt lookup
  or the draft programs, verified in one step) when speculative decoding is on,
  a plain `decode` step otherwise.
A request whose prompt is fully read stores its whole blocks in the prefix
cache. Every generated token is handed to the request's `sink` (from this
thread; the app forwards it to the event loop). A step that raises fails the
requests in flight with its error and the loop goes on serving; on several
ranks (which may be inside that step) it stops the loop instead, and the API
answers 503. `drain()` (the grace period ran out) ends every request with
reason "shutdown"; shutdown cancels what is left, frees every prefix-cache
block and tells other ranks to stop. Only this thread touches the runtime, the
prefix cache and the speculator; `submit`, `cancel` and `drain` may be called
from any thread (they take the lock).
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from flare.core.errors import FlareError

from .engine import StepEngine
from .metrics import ServeMetrics
from .policy import plan_step
from .prefix_cache import Block, PrefixCache
from flare.plugins.export.serving.sampling import SamplingParams, TokenChooser
from .speculative import Speculator
from .text import TextStream


class QueueFull(FlareError):
    """More requests are waiting than --max-queue allows (HTTP 429)."""


@dataclass
class Job:
    """One request as the loop sees it; `sink(event)` receives its events from the loop thread:
    {"token": id, "text": delta} per token, then {"done": finish_reason} or {"error": message}."""

    id: str
    prompt: tuple[int, ...]
    max_tokens: int
    params: SamplingParams
    stops: tuple[str, ...]
    sink: Callable[[dict[str, Any]], None]
    end_ids: frozenset[int] = frozenset()      # ids that end it besides the contract's <eos> (end of turn)
    decoder: Any = None                        # the tokenizer's incremental decoder (None: token-lm/1 bytes)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    cancel_reason: str = "cancelled"           # "shutdown": the grace period ran out
    cached_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    first_token: float | None = None
    finish_reason: str | None = None


@dataclass(eq=False)
class _Seq:
    job: Job
    slot: int
    chooser: TokenChooser
    text: TextStream
    fed: int = 0
    served: int = -1
    held: list[Block] = field(default_factory=list)
    stored: bool = False
    draft_wait: int = 0          # prompt lookup backs off: rounds left without proposals (speculative.py)
    draft_backoff: int = 0       # the next wait after a round whose proposals all missed
    draft_accepted: float = 0.0  # prompt lookup's acceptance so far, decayed (speculative.DraftLength)
    draft_rejected: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.job.tokens

    @property
    def req(self) -> Job:
        return self.job

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.job.prompt

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.job.prompt)

    @property
    def position(self) -> int:
        return self.fed + max(0, len(self.job.tokens) - 1)

    @property
    def budget(self) -> int:
        return self.job.max_tokens - len(self.job.tokens)


Observer = Callable[[str, str, list, np.ndarray, int], None]


@dataclass
class Turns:
    """What the loop schedules over: requests waiting for a slot, sequences running, free slots,
    and the kind of the last step (the policy alternates on it)."""

    waiting: deque[Job]
    running: list[_Seq]
    free: list[int]
    last: str | None = None

    @classmethod
    def empty(cls, max_seqs: int) -> "Turns":
        return cls(deque(), [], list(range(max_seqs)))


class ServeLoop:
    """Continuous batching on a StepEngine; see the module docstring.

    One loop for both fronts: `start()` runs it on its own thread for `flare serve`; `flare run
    NAME.core` drives the same `schedule` and `step` turn by turn (`flare.plugins.serve.offline`).
    `observer(kind, program, plan, logits, decoding)`, if given, hears every plain step after its
    tokens were emitted (`decoding`: sequences decoding when it was planned)."""

    def __init__(self, engine: StepEngine, *, mixed: bool, prefix_cache: PrefixCache | None = None,
                 speculator: Speculator | None = None, max_queue: int = 256, metrics: ServeMetrics | None = None,
                 observer: Observer | None = None):
        self.engine = engine
        self.serving = engine.serving
        self.mixed = mixed and engine.has("mixed")
        self.cache = prefix_cache
        self.spec = speculator
        self.max_queue = max_queue
        self.metrics = metrics if metrics is not None else ServeMetrics()
        self.observer = observer
        self._lock = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._stopping = False
        self._draining = False
        self._cancels = False             # a cancel since the waiting queue was last scanned
        self._thread = threading.Thread(target=self._main, name="flare-serve-steps", daemon=True)
        self.error: BaseException | None = None
        self.step_failures = 0
        self._waiting_count = 0
        self._turn = itertools.count()

    # ------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping or self._draining or self.error is not None:
                raise FlareError(f"the step loop failed: {self.error}" if self.error is not None
                                 else "the server is shutting down")
            if len(self._inbox) + self._waiting_count >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting (--max-queue)")
            self._inbox.append(job)
            self.metrics.queue_depth.set(len(self._inbox) + self._waiting_count)
            self._lock.notify()

    def cancel(self, job: Job) -> None:
        with self._lock:
            job.cancelled = True
            self._cancels = True
            self._lock.notify()

    def drain(self) -> None:
        """The grace period is over: refuse new requests and end every waiting and running one with
        reason "shutdown" at the next turn (their handlers answer 503 / an error event and [DONE])."""
        with self._lock:
            self._draining = True
            self._lock.notify()

    def shutdown(self, timeout: float | None = None) -> None:
        """Cancel what is left, free every block, stop other ranks; waits for the thread."""
        with self._lock:
            started = self._thread.ident is not None
            self._stopping = True
            self._lock.notify()
        if not started:                 # never ran: nothing to cancel, but other ranks wait for the word
            self.engine.stop()
        elif self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def cpu_seconds(self) -> float | None:
        """CPU seconds the loop's thread has run (its POSIX thread CPU clock, ns resolution), read from
        any thread at no cost to the loop; None before it starts, after it ends or where the platform
        has no such clock. Why: the work of serving itself, which a benchmark can compare between two
        servers far more steadily than wall time on a shared machine."""
        ident = self._thread.ident
        if ident is None or not self._thread.is_alive() or not hasattr(time, "pthread_getcpuclockid"):
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (OSError, OverflowError):
            return None

    # ---------------------------------------------------------- loop thread
    def _main(self) -> None:
        st = Turns.empty(self.serving.max_seqs)
        waiting, running = st.waiting, st.running
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._inbox and not running and not waiting:
                        self._lock.wait(0.5)
                    if self._stopping:
                        break
                    waiting.extend(self._inbox)
                    self._inbox.clear()
                    self._waiting_count = len(waiting)
                    if self._draining:
                        for j in [*waiting, *(s.job for s in running)]:
                            j.cancelled, j.cancel_reason = True, "shutdown"
                        self._cancels = True
                self.schedule(st)
                self._waiting_count = len(waiting)
                try:
                    self.step(st)
                except Exception as exc:
                    if self.engine.comm is not None:
                        raise             # the other ranks may be inside the step: stop them all
                    self._fail_running(running, st.free, exc)   # alone: those requests fail, the server goes on
                    st.last = None
                self.metrics.running.set(len(running))
        except BaseException as exc:  # noqa: BLE001 - every request in flight must hear about it
            self.error = exc
            for s in running:
                self._end(s.job, error=f"{type(exc).__name__}: {exc}")
            for j in waiting:
                self._end(j, error=f"{type(exc).__name__}: {exc}")
            running.clear()
            waiting.clear()
        finally:
            with self._lock:
                self._stopping = True
                left = list(self._inbox)
                self._inbox.clear()
            for s in running:
                self._end(s.job, reason="cancelled")
            for j in list(waiting) + left:
                self._end(j, reason="cancelled")
            self._waiting_count = 0
            try:
                if self.cache is not None:
                    self.cache.clear()
            finally:
                self.engine.stop()

    # ------------------------------------------------------------ one turn
    def schedule(self, st: Turns) -> None:
        """Drop cancelled requests, admit waiting ones into free slots (oldest first)."""
        self._drop_cancelled(st.waiting, st.running, st.free)
        while st.waiting and st.free:
            self._admit(st.waiting.popleft(), st.free.pop(0), st.running)
        self.metrics.queue_depth.set(len(st.waiting))
        self.metrics.running.set(len(st.running))

    def step(self, st: Turns) -> bool:
        """One step over the running sequences (if any), then retire the finished ones."""
        if not st.running:
            return False
        st.last = self._step(st.running, st.last)
        self._finish(st.running, st.free)
        return True

    def _fail_running(self, running: list[_Seq], free: list[int], exc: Exception) -> None:
        """A step raised: every request it may have touched gets the error and its slot back (their KV
        rows are rewritten before any later request's mask admits them)."""
        self.step_failures += 1
        for s in list(running):
            running.remove(s)
            free.append(s.slot)
            if self.cache is not None:
                self.cache.release(s.held)
            self._end(s.job, error=f"{type(exc).__name__}: {exc}")
        free.sort()

    def _drop_cancelled(self, waiting: deque[Job], running: list[_Seq], free: list[int]) -> None:
        with self._lock:
            scan, self._cancels = self._cancels, False
        if scan:                          # the waiting queue is scanned only after a cancel (it may be long)
            kept = [j for j in waiting if not j.cancelled]
            for j in [j for j in waiting if j.cancelled]:
                self._end(j, reason=j.cancel_reason)
            waiting.clear()
            waiting.extend(kept)
        for s in [s for s in running if s.job.cancelled]:
            self._retire(s, running, free, reason=s.job.cancel_reason)

    def _admit(self, job: Job, slot: int, running: list[_Seq]) -> None:
        s = _Seq(job, slot, TokenChooser(job.params, self.serving.never), TextStream(job.stops, job.decoder))
        if self.cache is not None:
            s.fed, s.held = self.cache.reuse(slot, job.prompt)
            job.cached_tokens = s.fed
        running.append(s)

    def _step(self, running: list[_Seq], last: str | None) -> str:
        kind, plan = plan_step(self.engine, running, last, self.mixed)
        turn = next(self._turn)
        if kind == "decode" and self.spec is not None:
            seqs = [s for s, _ in plan]
            new = self.spec.round(seqs)
            for j, s in enumerate(seqs):
                s.served = turn
                for tok in new[j]:
                    if not self._emit(s, tok):
                        break
            self.metrics.steps.labels("speculative").inc()
            return kind
        decoding = sum(1 for s in running if not s.prefilling)
        logits, bucket = self.engine.run(kind, [c for _, c in plan])
        self.metrics.steps.labels(kind).inc()
        read: list[_Seq] = []
        for (s, chunk), row in zip(plan, logits):
            s.served = turn
            if s.prefilling:
                s.fed += len(chunk.tokens)
                if s.prefilling:
                    continue
                if self.cache is not None and not s.stored:
                    read.append(s)
            self._emit(s, s.chooser(np.asarray(row), len(s.job.tokens)))
        for s in read:       # after the first token went out: copying blocks is no part of the time to it
            s.stored = True
            self.cache.store(s.slot, s.job.prompt, s.held)
        if self.observer is not None:
            self.observer(kind, bucket.program, plan, logits, decoding)
        return kind

    def _emit(self, s: _Seq, tok: int) -> bool:
        """Record a generated token; False once the request has finished (later tokens are dropped)."""
        job = s.job
        if job.finish_reason is not None:
            return False
        job.tokens.append(tok)
        if job.first_token is None:
            job.first_token = time.perf_counter()
            self.metrics.ttft.observe(job.first_token - job.arrival)
        self.metrics.generated.inc()
        delta = s.text.push(tok)
        if s.text.stopped or tok == self.serving.eos or tok in job.end_ids:
            job.finish_reason = "stop"
        elif len(job.tokens) >= job.max_tokens or s.position >= self.serving.max_ctx:
            job.finish_reason = "length"
        if job.finish_reason is not None:
            delta += s.text.flush()
        job.sink({"token": tok, "text": delta})
        return job.finish_reason is None

    def _finish(self, running: list[_Seq], free: list[int]) -> None:
        for s in [s for s in running if s.job.finish_reason is not None]:
            self._retire(s, running, free, reason=s.job.finish_reason)

    def _retire(self, s: _Seq, running: list[_Seq], free: list[int], reason: str) -> None:
        running.remove(s)
        free.append(s.slot)
        free.sort()
        if self.cache is not None:
            self.cache.release(s.held)
            s.held = []
        self._end(s.job, reason=reason)

    def _end(self, job: Job, reason: str | None = None, error: str | None = None) -> None:
        if error is not None:
            self.metrics.requests.labels("error").inc()
            job.sink({"error": error})
            return
        job.finish_reason = job.finish_reason or reason
        self.metrics.requests.labels(job.finish_reason or "cancelled").inc()
        job.sink({"done": job.finish_reason})
