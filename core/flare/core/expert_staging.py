"""Expert staging: keep only the experts a step selects resident in a bounded cache.

A mixture-of-experts model in offload mode gives each MoE layer a few `cache`
tensors (gate, up, down) of S expert slots on the device and calls a
`stage_experts` host node between the router's top-k and the expert matmuls
(`flare.core.specs.STAGE_EXPERTS`). `ExpertStager` is that callback, shared by
every model with experts stored as `[E, ...]` tensors (moe-lm's safetensors
file, a GGUF file's `ffn_*_exps`): it reads the selected ids, copies the
missing experts from the source (a memory-mapped file or host memory, rows
exactly as stored, quantized or not) into slots with `ctx.write_rows`, and
returns the slot of every (token, choice) so `mul_mat_id` indexes the cache.

Rules that keep outputs identical to resident experts:
- an expert the current step needs is never evicted, and a step needing more
  experts than there are slots is an `ExpertCacheError` (models check the
  largest planned step at load time; this checks every step again);
- one expert occupies at most one slot, so the matmul groups tokens exactly as
  it does with expert ids.
Consecutive missing experts bound for consecutive slots are copied with one
write per tensor, since the source stores experts contiguously.

Eviction: the least *often* used expert that the step does not need, ties by
least recently used. Trained routers (and moe-lm's skewed synthetic one) have
popular experts; counting uses keeps them resident where plain LRU lets a burst
of rare ones (a prefill chunk) push them out. Counts are halved every
`AGE_EVERY` calls of a layer so a shift in popularity wins in time. On the
moe-lm `mid` benchmark this copies ~16% fewer experts than LRU (an offline
replay: LRU 388, this 323, Belady's optimum 263 misses).

Prefetch (`prefetch=n`, off by default): the router of layer i+1 needs layer
i's output, which is not known while layer i is staged. So after staging
layer i, the stager guesses layer i+1's experts by applying layer i+1's FFN
RMS norm and router to the residual stream as it enters layer i's FFN (the
host node's third input; the stream changes little in one layer, and with
layer i+1's own norm weights the guess is what layer i+1 would pick if layer
i's FFN and layer i+1's attention added nothing; the guess runs on the
caller's thread, a [T, D] x [D, E] product), takes each
token's top n and copies the missing ones on one background thread while the
device computes layer i's experts and layer i+1's attention. Layer i+1's
staging call first settles that copy, then stages as always, so outputs never
change: only copy time leaves the critical path. Settling takes back every
copy the helper has not started (a `_PrefetchJob` hands out one run at a
time): it copies the ones this step needs itself, drops the wrong guesses
(their slots become free again) and waits only for the run in flight. So a
busy machine, where the helper thread may not get a core in time, costs at
most what staging without prefetch costs, and a wrong guess costs a copy only
when the helper had time for it (and possibly an eviction). The background copy writes the
caches from another thread, which only host-memory (CPU) caches allow; models
refuse prefetch where an expert cache lives on another device.

Threads: one stager belongs to one prepared graph. Its calls come from that
graph's executes, which take turns on the graph's lock, so it takes no lock of
its own for them; its one helper thread only copies the runs of the current
`_PrefetchJob` (claimed under the job's lock, counted in the job, not in
`stats`), and every other method settles that job first (`drain`).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .errors import ModelError

AGE_EVERY = 64   # staging calls of a layer between halvings of its use counts

# layer -> the names of its expert cache tensors (the source uses the same names)
TensorNames = Callable[[int], Sequence[str]]
# name -> the source tensor [E, ...] (a view of a mapped file, or host memory)
Source = Callable[[str], np.ndarray]
# layer -> (router weight [E, D], bias [E] or None, FFN RMS-norm weight [D]), for prefetch guesses
Router = Callable[[int], "tuple[np.ndarray, np.ndarray | None, np.ndarray]"]


class ExpertCacheError(ModelError):
    """The expert cache cannot hold the experts one step of one layer needs."""


@dataclass
class StagingStats:
    """Counters since the last `reset_stats()`. `experts_staged` counts demand misses only;
    `copies` (merged runs), `writes` (write_rows calls) and `bytes_staged` include prefetch copies."""

    calls: int = 0
    selected: int = 0
    hits: int = 0
    experts_staged: int = 0
    copies: int = 0
    writes: int = 0
    bytes_staged: int = 0
    evictions: int = 0
    seconds: float = 0.0                # in staging calls, including their demand copies
    prefetched: int = 0                 # experts copied ahead of time by the background thread
                                        # (guesses it had not started are copied on demand or dropped)
    prefetch_hits: int = 0              # selected experts resident only thanks to a prefetch
    prefetch_seconds: float = 0.0       # background copy time (off the critical path)
    prefetch_wait_seconds: float = 0.0  # staging calls waiting for a background copy to finish

    @property
    def hit_rate(self) -> float:
        return self.hits / self.selected if self.selected else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class StageRecord:
    """What one staging call did (kept when tracing): for tests and debugging."""

    layer: int
    selected: tuple[int, ...]
    staged: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...]  # (first expert, first slot, count)
    evicted: tuple[int, ...]
    prefetched: tuple[int, ...] = ()        # experts of layer+1 guessed and handed to the background thread


class _LayerCache:
    """Which expert each slot of one layer holds, with use counts and recency for eviction."""

    def __init__(self, slots: int, n_experts: int):
        self.expert_in: list[int | None] = [None] * slots
        self.slot_of: dict[int, int] = {}
        self.table = np.zeros(n_experts, np.int32)        # expert -> slot (valid where resident)
        self.uses = np.zeros(n_experts, np.float64)
        self.lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.unused_prefetch: set[int] = set()
        self.calls = 0

    def take(self, slot: int) -> int | None:
        """Empty `slot`; returns the expert it held."""
        old = self.expert_in[slot]
        if old is not None:
            del self.slot_of[old], self.lru[old]
            self.unused_prefetch.discard(old)
            self.expert_in[slot] = None
        return old

    def place(self, runs: list[tuple[int, int, int]]) -> None:
        for first, slot, count in runs:
            for j in range(count):
                self.expert_in[slot + j] = first + j
                self.slot_of[first + j] = slot + j
                self.table[first + j] = slot + j
                self.lru[first + j] = None

    def use(self, needed: list[int]) -> None:
        """Count a step's selections (halving all counts every AGE_EVERY calls); most recent last."""
        self.calls += 1
        if self.calls % AGE_EVERY == 0:
            self.uses *= 0.5
        self.uses[needed] += 1.0
        for e in needed:
            self.lru.move_to_end(e)

    def victims(self, count: int, keep: set[int]) -> list[int]:
        """Up to `count` slots: free ones first, then the least used experts not in `keep`
        (ties: least recently used first)."""
        out = [s for s, e in enumerate(self.expert_in) if e is None][:count]
        if len(out) < count:
            order = [e for e in self.lru if e not in keep]          # oldest first
            order.sort(key=lambda e: self.uses[e])                  # stable: ties stay oldest first
            out += [self.slot_of[e] for e in order[: count - len(out)]]
        return out


class _PrefetchJob:
    """Background copies of one layer's guessed experts, handed out one run at a time so the
    staging thread can take back the runs the helper has not started."""

    def __init__(self, layer: int, runs: list[tuple[int, int, int]]):
        self.layer = layer
        self.runs = runs
        self.lock = threading.Lock()
        self.next = 0
        self.copied: list[tuple[int, int, int]] = []   # runs the helper copied (helper thread only)
        self.seconds = 0.0
        self.future: Future | None = None

    def claim(self) -> tuple[int, int, int] | None:
        with self.lock:
            if self.next >= len(self.runs):
                return None
            self.next += 1
            return self.runs[self.next - 1]

    def claim_rest(self) -> list[tuple[int, int, int]]:
        with self.lock:
            rest, self.next = self.runs[self.next:], len(self.runs)
            return rest


class ExpertStager:
    """The `stage_experts` host callback of one prepared MoE model (see the module docstring).

    label: the model's name for messages; tensors(layer): its cache tensor names, which are
    also the source's names; source(name): [E, ...] experts as stored; scratch_row: the KV row
    of padding tokens (they stage nothing); router(layer): for prefetch guesses."""

    def __init__(self, *, label: str, n_layers: int, n_experts: int, slots: int, scratch_row: int,
                 tensors: TensorNames, source: Source, trace: bool = False, prefetch: int = 0,
                 router: Router | None = None):
        self.label = label
        self.n_layers = int(n_layers)
        self.n_experts = int(n_experts)
        self.slots = int(slots)
        self.scratch_row = int(scratch_row)
        self._names = [tuple(tensors(i)) for i in range(self.n_layers)]
        self._sources = [tuple(source(n) for n in names) for names in self._names]
        self.trace = trace
        self.records: list[StageRecord] = []
        self.stats = StagingStats()
        self._layers = self._empty_layers()
        self.prefetch = 0
        self._routers: list[tuple[np.ndarray, np.ndarray | None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._job: _PrefetchJob | None = None
        if prefetch:
            self.enable_prefetch(prefetch, router)

    def _empty_layers(self) -> list[_LayerCache]:
        return [_LayerCache(self.slots, self.n_experts) for _ in range(self.n_layers)]

    def enable_prefetch(self, prefetch: int, router: Router | None) -> None:
        """Guess `prefetch` experts per token of the next layer with `router` (see the module docstring)."""
        if router is None:
            raise ModelError(f"{self.label}: expert prefetch needs the router weights")
        routers = []
        for i in range(self.n_layers):
            weight, bias, norm = router(i)
            folded = np.asarray(weight, np.float32) * np.asarray(norm, np.float32)[None, :]  # router(norm_w * x)
            routers.append((np.ascontiguousarray(folded.T), None if bias is None else np.asarray(bias, np.float32)))
        self._routers = routers
        self.prefetch = int(prefetch)

    # -- lifecycle ----------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget what the caches hold (a new prepared graph starts empty)."""
        self.drain()
        self._layers = self._empty_layers()

    def drain(self) -> None:
        """Settle a background prefetch (before anything else touches the caches): drop the
        copies it has not started, wait for the one in flight."""
        self._settle(())

    def _settle(self, needed: Sequence[int], ctx: Any = None) -> int:
        """End the pending prefetch job: take back its unstarted runs, copy those of them that
        hold an expert in `needed` here (with `ctx`), free the slots of the others, wait for the
        run in flight; then count what the helper copied. Returns how many experts it copied here."""
        job, self._job = self._job, None
        if job is None:
            return 0
        rest = job.claim_rest()
        assert job.future is not None
        if not job.future.cancel():       # started (or done): at most the run in flight remains
            t0 = time.perf_counter()
            try:
                job.future.result()
            finally:
                self.stats.prefetch_wait_seconds += time.perf_counter() - t0
        cache = self._layers[job.layer]
        want = set(needed)
        mine: list[int] = []
        for first, slot, count in rest:
            for j in range(count):
                if first + j in want:
                    mine.append(first + j)
                else:
                    cache.take(slot + j)      # a wrong guess nobody copied: the slot is free again
        if mine:                              # needed now: copied here, as a demand copy would be
            self._copy(job.layer, _runs(mine, sorted(cache.slot_of[e] for e in mine)), ctx)
            cache.unused_prefetch.difference_update(mine)
        st = self.stats
        st.prefetched += sum(n for _, _, n in job.copied)
        st.copies += len(job.copied)
        st.writes += len(job.copied) * len(self._names[job.layer])
        st.bytes_staged += sum(int(src[0].nbytes) * n for src in self._sources[job.layer] for _, _, n in job.copied)
        st.prefetch_seconds += job.seconds
        return len(mine)

    def close(self) -> None:
        """Drain and stop the background thread (idempotent); call before the caches are released."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def reset_stats(self) -> None:
        self.stats = StagingStats()
        self.records = []

    def resident(self, layer: int) -> dict[int, int]:
        """expert -> slot of a layer's cache right now (after settling a pending prefetch, so every
        slot listed holds its expert's bytes)."""
        self.drain()
        return dict(self._layers[layer].slot_of)

    # -- the host callback --------------------------------------------------------
    def __call__(self, node: Any, ids: np.ndarray, rows: np.ndarray | None = None, hidden: np.ndarray | None = None,
                 *, ctx: Any) -> np.ndarray:
        layer = int(node.params["args"]["layer"])
        ids = np.asarray(ids)
        valid = None if rows is None else (np.asarray(rows).reshape(-1) != self.scratch_row)
        out = self.stage(layer, ids, valid, ctx)
        if self.prefetch and hidden is not None and layer + 1 < self.n_layers:
            h = np.asarray(hidden)
            self._prefetch(layer + 1, h if valid is None else h[valid], ctx)
        return out

    def stage(self, layer: int, ids: np.ndarray, valid: np.ndarray | None, ctx: Any) -> np.ndarray:
        """Make the experts in `ids` (rows of tokens where `valid`) resident; return their slots."""
        t0 = time.perf_counter()
        chosen = ids if valid is None else ids[valid]
        needed = sorted(set(chosen.reshape(-1).tolist()))
        taken_back = self._settle(needed if self._job.layer == layer else (), ctx) if self._job is not None else 0
        cache = self._layers[layer]
        if len(needed) > self.slots:
            raise ExpertCacheError(
                f"{self.label}: layer {layer}: a step selects {len(needed)} distinct experts for "
                f"{chosen.shape[0]} token(s), but the expert cache has {self.slots} slot(s) per layer")
        if needed and (needed[0] < 0 or needed[-1] >= self.n_experts):
            raise ExpertCacheError(f"{self.label}: layer {layer}: expert id out of range 0..{self.n_experts - 1}")
        missing = [e for e in needed if e not in cache.slot_of]
        prefetch_hits = 0
        if cache.unused_prefetch:
            prefetch_hits = len(cache.unused_prefetch.intersection(needed))
            cache.unused_prefetch.difference_update(needed)
        victims = cache.victims(len(missing), set(needed)) if missing else []
        if len(victims) < len(missing):  # guarded by the slot check above; kept as a last line
            raise ExpertCacheError(f"{self.label}: layer {layer}: no slot to evict ({self.slots} slots)")
        evicted = [old for old in (cache.take(slot) for slot in victims) if old is not None]
        runs = _runs(missing, sorted(victims))
        cache.place(runs)
        self._copy(layer, runs, ctx)
        cache.use(needed)
        out = cache.table[ids]
        st = self.stats
        st.calls += 1
        st.selected += len(needed)
        st.hits += len(needed) - len(missing) - taken_back
        st.experts_staged += len(missing) + taken_back
        st.evictions += len(evicted)
        st.prefetch_hits += prefetch_hits
        st.seconds += time.perf_counter() - t0
        if self.trace:
            self.records.append(StageRecord(layer, tuple(needed), tuple(missing), tuple(runs), tuple(evicted)))
        return out

    def _copy(self, layer: int, runs: list[tuple[int, int, int]], ctx: Any) -> None:
        st = self.stats
        for first, slot, count in runs:
            for name, src in zip(self._names[layer], self._sources[layer]):
                part = src[first: first + count]
                ctx.write_rows(name, slot, part)
                st.writes += 1
                st.bytes_staged += int(part.nbytes)
        st.copies += len(runs)

    def _prefetch(self, layer: int, hidden: np.ndarray, ctx: Any) -> None:
        """Guess `layer`'s experts from the previous layer's FFN input; copy them in the background."""
        if hidden.size == 0:
            return
        weight_t, bias = self._routers[layer]
        x = hidden.reshape(-1, weight_t.shape[0]).astype(np.float32, copy=False)
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)       # the RMS norm, its weight folded in
        logits = x @ weight_t
        if bias is not None:
            logits += bias
        n = min(self.prefetch, self.n_experts)
        top = np.argpartition(-logits, n - 1, axis=-1)[:, :n] if n < self.n_experts else np.argsort(-logits, -1)
        guess = sorted(set(top.reshape(-1).tolist()))
        cache = self._layers[layer]
        missing = [e for e in guess if e not in cache.slot_of][: self.slots]
        victims = cache.victims(len(missing), set(guess)) if missing else []
        missing = missing[: len(victims)]
        if not missing:
            return
        for slot in victims:
            cache.take(slot)
        runs = _runs(missing, sorted(victims))
        cache.place(runs)
        cache.unused_prefetch.update(missing)
        if self.trace and self.records:
            last = self.records[-1]
            self.records[-1] = StageRecord(last.layer, last.selected, last.staged, last.runs, last.evicted,
                                           tuple(missing))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-prefetch")
        job = _PrefetchJob(layer, runs)
        job.future = self._pool.submit(self._work, job, ctx)
        self._job = job

    def _work(self, job: _PrefetchJob, ctx: Any) -> None:
        """The helper thread: copy the job's runs until the staging thread takes the rest back."""
        t0 = time.perf_counter()
        try:
            while (run := job.claim()) is not None:
                for name, src in zip(self._names[job.layer], self._sources[job.layer]):
                    first, slot, count = run
                    ctx.write_rows(name, slot, src[first: first + count])
                job.copied.append(run)
        finally:
            job.seconds = time.perf_counter() - t0


def _runs(experts: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """Pair sorted experts with sorted slots; merge where both are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for e, s in zip(sorted(experts), slots):
        if runs and e == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((e, s, 1))
    return runs
