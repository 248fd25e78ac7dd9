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
replay of its routing: LRU 388, this 323, Belady's optimum 263 misses).

Prefetch (`prefetch=n`, off by default): the router of layer i+1 needs layer
i's output, which is not known while layer i is staged. So after staging
layer i, the stager hands layer i's FFN input (the residual stream; the host
node's third input) to one helper thread, which guesses layer i+1's experts by
applying layer i+1's own FFN RMS norm and router to it (the stream changes
little in one layer: the guess is what layer i+1 would pick if layer i's FFN
and layer i+1's attention added nothing), takes each token's top n, picks
slots for the missing ones and copies them, one run at a time, while the
device computes layer i's experts and layer i+1's attention. The staging
thread only queues the job: guessing and copying are off the critical path.
Layer 0 has no layer before it: the model queues its job right before the
execute (`prefetch_layer`) from the step's token embeddings, which is what
layer 0's FFN sees but for layer 0's attention.
Layer i+1's staging call settles the job first, then stages as always, so
outputs never change. Settling cancels a job the helper has not begun, takes
back the runs it has not started (copying the ones this step needs itself,
freeing the slots of wrong guesses) and waits only for the run in flight, so
outputs never depend on how far the helper got. The helper writes the caches
from another thread, which only host-memory (CPU) caches allow; models refuse
prefetch where an expert cache lives on another device. It is meant for a
session computing on one thread, the helper taking the machine's second core.

What it costs, measured on the 2-vCPU machine (AMD EPYC VM), 1 compute thread
(`bench/staging_breakdown.py` on bench/configs/gguf_moe_*.toml): a GGUF decode
step (bench-moe, 4 layers) is ~280-300 us resident. Staging adds, per step, 4
host-node round trips, ~26 us together with every expert resident (36 before
the lean path below): each a host step of ~3.5 us, of which this callback ~3
us (a set of the ids, the use counts, one lookup in the layer's slot table
written straight into the node's output; the host step lends its inputs as
views, `flare.core.host_calls`), and ~1.5 us for the extra device split; and
per missing expert three byte copies, ~15 us with the file's pages in cache,
~30 us from memory (221 KB of Q4_0). The bench's requests (8 prompt
tokens as two 4-token prefill chunks, 31 decode steps) copy 46 experts each, 36
of them in the prefill: a 4-token chunk needs up to 8 distinct experts of a
layer's 8 slots, and the decode steps have evicted the prompt's experts by the
next request (Belady's optimum on that routing would copy 42, plain LRU 50), so
a `count = "decode"` ratio carries the prompt's staging too. What is left is
mostly those copies and the round trips; a guard that skipped the callback in
the native CPU walk when every selected expert is resident (a slot table as a
cache tensor the graph gathers from) would remove most of the round trips.

On the moe-lm `mid` bench pair (bench/configs/moe_{resident,offload}.toml: 2 layers, 64
experts of 393 KB f32, 12 slots per layer; a request is a 48-token prompt in 4-token
chunks and 16 decode steps, so 27 executes and 54 staging calls) the copies are what is
left. Per request, thread CPU, p10 of alternated runs in one process: resident 6.6 ms;
offload 8.3 ms; offload with the copies skipped (slots pre-filled, outputs wrong, a
bound only) 6.2 ms, i.e. the round trips and the bookkeeping cost no more than the small
cache's locality gives back; offload with every expert resident (64 slots, all hits, no
locality gain) 7.8 ms against resident's 6.8 in another run, ~18 us per staging call
over a request; timed alone, a decode execute takes ~8 us more per host node: ~3.8 us
the host step (this callback ~3.5) and ~4 us for leaving and re-entering the native
walk. The copies: ~75 experts (29.5 MB) per request, 52 in the prompt's prefill, ~21-28
us each (a single core's copy bandwidth, ~15-18 GB/s; non-temporal or prefetching copy
loops measured slower than NumPy's). Eviction is near its limit on that routing: an
offline replay gives LRU 96, this order 75, Belady's optimum 62 copies per request; age
periods 16-256, weighting decode or prefill uses and an exponential decay all land
within 74-76, one pool of 24 slots shared by both layers at 71. Only a quarter of the
staging calls are all hits, so a guard that skipped them in the native walk would save
~0.1-0.25 ms a request (2-4%), less the copies that use counts it skipped would cost.
What would move the ratio is not copying: a miss read in place from the mapped source by
the CPU matmul (a per-slot source pointer; the cache then holds what is reused) or a
larger cache (a replay: 14 slots 61 copies, 16 slots 51; 16 slots, 0.28x the resident
device bytes, took 6% less time per request than 12, alternated).

The staging step in C (`expert_stage_step`, a device's optional factory; the CPU device's is
backends/flare/backends/cpu/native/staging.c): where a layer's caches are in host memory and its
sources are contiguous bytes, and prefetch is off, `stage` hands the step to C: the set of
selected ids, the misses, the victims, the slot table, the use counts and ticks, the copies (one
memcpy per tensor and run) and the slots of every (token, choice), on arrays this stager owns
(`_NativeLayer`: the same records as `_LayerCache`, so `resident()`, `StagingStats` and traces
stay right; tests/test_expert_staging_native.py replays one routing through both paths and
compares slots, records, counters and cache bytes). The Python path stays the reference, and the
path for caches on other devices and for prefetch (whose helper works on `_LayerCache`); a layer
that changes path starts empty (re-copies, same outputs). On the moe-lm `mid` pair (16 slots) it
took the stager's own time per request from ~1.51-1.59 to ~1.15-1.23 ms (its copies from
~1.01-1.08 to ~0.84-0.92 ms: no Python between the runs) and the host steps from ~1.69-1.81 to
~1.35-1.46 ms (thread CPU, p10, bench/staging_breakdown.py, four alternated runs a side). What
it left: the host node itself (the callback's Python around the C call, ~3 us; the host step,
~4 us; leaving and re-entering the native walk, ~4 us, per call) and the copies.

The step inside the command list: where the stager would take the C step (`native`, no
prefetch) and keeps no trace (records are the host path's), `runs_in_walk` tells the
partitioner to leave the `stage_experts` node in the CPU split, and `walk_command` gives the
device's `stage_experts` command (kernels.c; `WalkBlock` in the CPU backend's native/staging.py):
the walk reads the ids and KV rows from the split's memory, runs staging.c's step on the same
`_NativeLayer` arrays (the block's pointers are rebound whenever this stager replaces them:
`invalidate`, a layer's first C step) and writes the slots, never leaving C. Its counters go to
`_acc`, folded into `stats` when read; a failing step stops the walk, which raises this
stager's `ExpertCacheError` (`_walk_error`; the step changes nothing before failing). Changing
`native`, `in_walk` or prefetch after prepare plans the graph again (`PreparedGraph.replan`),
so compiled commands never stage a layer the Python path owns. Measured alternated against the
host node (4 runs a side of bench/staging_breakdown.py, thread CPU, p10; shared machine):
offload/resident time per request on the moe-lm `mid` pair 1.30 (1.28-1.37) -> 1.16
(1.12-1.25), on the GGUF bench-moe pair 1.18 (1.15-1.21) -> 1.10 (1.04-1.12).

Prefetch saves little of that: it avoids ~0.1 (GGUF, hit rate 0.85 ->
0.89) to ~0.6 (moe-lm `mid` prefill, 0.66 -> 0.78) demand copies per staging
call, but each job costs the staging thread the hand-over (waking the helper:
tens of microseconds on these VMs, more when the machine is busy), the GIL
while the helper runs its guess (~6 us, 13 with a router bias) and copies,
and the bandwidth its copies take from the compute thread, more than the
copies it saves: prefetch was slower than staging without it in every
side-by-side run here. A native copy thread (C, no GIL, the guess on the
staging thread) was tried and backed out, measured no better. Prefetch can pay
where guesses are right more often, experts are large next to the staging
call's fixed costs, and a hand-over between cores is cheap.

Threads: one stager belongs to one prepared graph. (The C step runs with the GIL released, as
cffi calls do; it touches only this stager's arrays and the graph's caches. Inside the walk it
runs on whichever of the device's threads takes that command, one at a time, within the
execute; the stager rebinds blocks and folds counters only between executes.) Its calls come from that
graph's executes, which take turns on the graph's lock, so it takes no lock of
its own for them. While a job is pending, the helper alone touches the target
layer's cache records (the staging thread works on the layer before) and the
job's own counters; the job's condition orders the hand-over; every method
that reads caches or counters settles the job first (`drain`). `close()` stops
the helper; the helper thread itself holds only its queue (the stager only
through a pending job), so a stager dropped without `close()` is collected and
its finalizer stops the thread.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .errors import InputError, ModelError

AGE_EVERY = 64   # staging calls of a layer between halvings of its use counts

# layer -> the names of its expert cache tensors (the source uses the same names)
TensorNames = Callable[[int], Sequence[str]]
# name -> the source tensor [E, ...] (a view of a mapped file, or host memory)
Source = Callable[[str], np.ndarray]
# layer -> (router weight [E, D], bias [E] or None, FFN RMS-norm weight [D]), for prefetch guesses
Router = Callable[[int], "tuple[np.ndarray, np.ndarray | None, np.ndarray]"]
Run = tuple[int, int, int]   # (first expert, first slot, count)
RunWriter = Callable[[Sequence[Run], np.ndarray], None]   # write(runs, source): source rows into slots


class ExpertCacheError(ModelError):
    """The expert cache cannot hold the experts one step of one layer needs."""


@dataclass
class StagingStats:
    """Counters since the last `reset_stats()`. `experts_staged` counts demand misses (including
    guessed experts the helper had not copied yet); `copies` (merged runs), `writes` (writer calls:
    one per tensor and run, or per tensor and staging call where the caches are in host memory) and
    `bytes_staged` include the helper's copies."""

    calls: int = 0
    selected: int = 0
    hits: int = 0
    experts_staged: int = 0
    copies: int = 0
    writes: int = 0
    bytes_staged: int = 0
    evictions: int = 0
    seconds: float = 0.0                # in staging calls, including their demand copies
    copy_seconds: float = 0.0           # of which the demand copies (the source's bytes into the slots)
    prefetched: int = 0                 # experts the helper copied ahead of time
    prefetch_hits: int = 0              # selected experts resident only thanks to the helper
    prefetch_seconds: float = 0.0       # the helper's guessing and copying (off the critical path)
    prefetch_wait_seconds: float = 0.0  # staging calls waiting for the helper's run in flight

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
    runs: tuple[Run, ...]
    evicted: tuple[int, ...]
    prefetched: tuple[int, ...] = ()        # experts of layer+1 the helper guessed (and had slots for)


class _LayerCache:
    """Which expert each slot of one layer holds, with use counts and recency for eviction.

    Recency is a tick per expert (the staging call that last used it; an expert placed without
    a use, by a prefetch, sits half a tick after the call before it), ties by expert id: the order
    an LRU list moved to its end in ascending ids per call would keep, at a list store per use
    instead of a linked-list move (the all-hit step's bookkeeping is this and the counts)."""

    def __init__(self, slots: int, n_experts: int):
        self.expert_in: list[int | None] = [None] * slots
        self.empty = slots                                # slots holding no expert (none once warm)
        self.slot_of: dict[int, int] = {}
        self.table = np.zeros(n_experts, np.int32)        # expert -> slot (valid where resident)
        self.uses = [0.0] * n_experts
        self.last = [0.0] * n_experts                     # recency tick of each expert
        self.unused_prefetch: set[int] = set()
        self.calls = 0

    def take(self, slot: int) -> int | None:
        """Empty `slot`; returns the expert it held."""
        old = self.expert_in[slot]
        if old is not None:
            del self.slot_of[old]
            if self.unused_prefetch:
                self.unused_prefetch.discard(old)
            self.expert_in[slot] = None
            self.empty += 1
        return old

    def place(self, runs: list[Run]) -> None:
        tick = self.calls + 0.5                           # newer than the last call's uses, older than the next's
        expert_in, slot_of, table, last = self.expert_in, self.slot_of, self.table, self.last
        for first, slot, count in runs:
            for j in range(count):
                if expert_in[slot + j] is None:
                    self.empty -= 1
                expert_in[slot + j] = first + j
                slot_of[first + j] = slot + j
                table[first + j] = slot + j
                last[first + j] = tick

    def use(self, needed: list[int]) -> None:
        """Count a step's selections (halving all counts every AGE_EVERY calls); most recent last."""
        self.calls = calls = self.calls + 1
        if calls % AGE_EVERY == 0:
            self.uses = [u * 0.5 for u in self.uses]
        uses, last = self.uses, self.last
        for e in needed:
            uses[e] += 1.0
            last[e] = calls

    def victims(self, count: int, keep: set[int]) -> list[int]:
        """Up to `count` slots: free ones first, then the least used experts not in `keep`
        (ties: least recently used first)."""
        out = [s for s, e in enumerate(self.expert_in) if e is None][:count] if self.empty else []
        need = count - len(out)
        if need > 0:
            uses, last, slot_of = self.uses, self.last, self.slot_of
            key = lambda e: (uses[e], last[e], e)   # noqa: E731  (unique keys: min is sorted's first)
            if need == 1:                          # the common miss (a decode step): one pass, no sort
                rest = [e for e in slot_of if e not in keep]
                if rest:
                    out.append(slot_of[min(rest, key=key)])
            else:
                out += [slot_of[e] for e in sorted((e for e in slot_of if e not in keep), key=key)[:need]]
        return out


class _NativeLayer:
    """One layer's policy state as arrays, for a device's staging step in C (`expert_stage_step`):
    the same records as `_LayerCache` (expert -> slot table, the expert of each slot, use counts,
    recency ticks, calls, empty slots), which the C step reads and updates in place, plus its
    scratch (`mark`) and what it reports per call (`info`: needed, missing, evicted, runs, copy
    nanoseconds; `record`: those experts and runs, for traces)."""

    def __init__(self, slots: int, n_experts: int):
        self.table = np.zeros(n_experts, np.int32)
        self.expert_in = np.full(slots, -1, np.int32)
        self.uses = np.zeros(n_experts, np.float64)
        self.last = np.zeros(n_experts, np.float64)
        self.counters = np.array([0, slots], np.int64)   # calls, empty slots
        self.mark = np.zeros(n_experts, np.uint8)
        self.record = np.zeros(6 * slots, np.int32)
        self.info = np.zeros(5, np.int64)

    @property
    def slot_of(self) -> dict[int, int]:
        return {int(e): s for s, e in enumerate(self.expert_in.tolist()) if e >= 0}


QUEUED, PLANNING, COPYING, DONE, CANCELLED = range(5)


class _PrefetchJob:
    """One layer's guess-and-copy on the helper thread. `cond` orders the hand-over: the staging
    thread may cancel it while QUEUED, waits while PLANNING (the helper then edits the layer's
    cache records), takes back the runs not yet started while COPYING and waits for `busy`."""

    def __init__(self, stager: "ExpertStager", layer: int, hidden: np.ndarray | Callable[[], np.ndarray],
                 writers: Sequence[tuple[RunWriter, np.ndarray]]):
        self.stager = stager                 # the helper reaches the stager only through a pending job
        self.layer = layer
        self.hidden = hidden
        self.writers = writers
        self.cond = threading.Condition()
        self.state = QUEUED
        self.runs: list[Run] = []
        self.next = 0
        self.busy = False
        self.guessed: tuple[int, ...] = ()
        self.copied: list[Run] = []
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.record: int | None = None      # index of the traced staging call that queued it


class ExpertStager:
    """The `stage_experts` host callback of one prepared MoE model (see the module docstring).

    label: the model's name for messages; tensors(layer): its cache tensor names, which are
    also the source's names; source(name): [E, ...] experts as stored; scratch_row: the KV row
    of padding tokens (they stage nothing); router(layer): for prefetch guesses."""

    def __init__(self, *, label: str, n_layers: int, n_experts: int, slots: int, scratch_row: int,
                 tensors: TensorNames, source: Source, trace: bool = False, prefetch: int = 0,
                 router: Router | None = None, native: bool = True):
        self.label = label
        self.n_layers = int(n_layers)
        self.n_experts = int(n_experts)
        self.slots = int(slots)
        self.scratch_row = int(scratch_row)
        self._names = [tuple(tensors(i)) for i in range(self.n_layers)]
        # plain ndarray views (np.asarray drops numpy.memmap's subclass: slicing one costs ~1 us more)
        self._sources = [tuple(np.asarray(source(n)) for n in names) for names in self._names]
        self._expert_bytes = [sum(int(src[0].nbytes) for src in srcs) for srcs in self._sources]
        self.trace = trace
        self.records: list[StageRecord] = []
        self._stats = StagingStats()
        self._layers = self._empty_layers()
        self.prefetch = 0
        self._routers: list[tuple[np.ndarray, np.ndarray | None]] = []
        self._jobs: queue.SimpleQueue | None = None
        self._helper: threading.Thread | None = None
        self._stop_helper: weakref.finalize | None = None
        self._job: _PrefetchJob | None = None
        self._writer_ctx: Any = None
        # per layer: (in host memory, ((runs writer, source) per tensor))
        self._writers: list[tuple[bool, tuple[tuple[RunWriter, np.ndarray], ...]]] = []
        # False: settling waits for the whole job instead of taking unstarted copies back (the
        # counters then do not depend on thread timing: tests use it to check the guesses)
        self.take_back = True
        # the staging step in C where the device offers one (`_native_step`); False: always Python
        self._native = bool(native)
        self._native_ctx: Any = None
        self._native_steps: list[Any] = []          # per layer: the device's step, or None (Python)
        self._native_layers: list[_NativeLayer | None] = [None] * self.n_layers
        # the step inside the device's command list (no host split) where the device has one:
        # per layer, the compiled commands' blocks (`walk_command`), which point at the layer's
        # `_NativeLayer` and add to its row of `_acc` (folded into `stats` when it is read)
        self._in_walk = True
        self._walk: list[weakref.WeakSet] = [weakref.WeakSet() for _ in range(self.n_layers)]
        self._acc = np.zeros((self.n_layers, 8), np.int64)
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
        self.drain()
        self._routers = routers
        self.prefetch = int(prefetch)       # the Python path from now on: the C records are void
        self._replan_walk()                 # prefetch is the host node's: compiled commands give way
        for layer, state in enumerate(self._native_layers):
            if state is not None:           # dropped now, before the helper plans on the Python records
                self._native_layers[layer] = None
                self._layers[layer] = _LayerCache(self.slots, self.n_experts)

    # -- lifecycle ----------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget what the caches hold (a new prepared graph starts empty)."""
        self.drain()
        self._layers = self._empty_layers()
        self._writer_ctx, self._writers = None, []
        self._native_ctx, self._native_steps = None, []
        self._native_layers = [None] * self.n_layers
        for layer, blocks in enumerate(self._walk):    # compiled commands stage on fresh records
            if blocks:
                self._native_layers[layer] = state = _NativeLayer(self.slots, self.n_experts)
                for block in blocks:
                    block.bind(state)

    @property
    def native(self) -> bool:
        """Whether staging takes the device's C step where it has one (else the Python path)."""
        return self._native

    @native.setter
    def native(self, value: bool) -> None:
        self._switch("_native", value)

    @property
    def in_walk(self) -> bool:
        """Whether the C step may run as a command inside the device's split (`runs_in_walk`)
        rather than behind the host node; set before prepare, or the graph is planned again."""
        return self._in_walk

    @in_walk.setter
    def in_walk(self, value: bool) -> None:
        self._switch("_in_walk", value)

    def _switch(self, attr: str, value: bool) -> None:
        """Set a path switch; where compiled commands stage a layer, plan the graph again (they
        would go on staging the C way: `runs_in_walk` is asked when a graph is planned)."""
        if bool(value) == getattr(self, attr):
            return
        setattr(self, attr, bool(value))
        self._replan_walk()

    def _replan_walk(self) -> None:
        ctx = self._native_ctx
        if any(self._walk) and ctx is not None and hasattr(ctx, "replan"):
            for blocks in self._walk:
                blocks.clear()
            ctx.replan()

    @property
    def stats(self) -> StagingStats:
        """The counters (the in-walk commands' folded in first)."""
        if self._acc.any():
            self._fold_walk()
        return self._stats

    @stats.setter
    def stats(self, value: StagingStats) -> None:
        self._stats = value

    def _fold_walk(self) -> None:
        for layer, (calls, needed, missing, evicted, runs, copy_ns, step_ns, copying) in enumerate(self._acc.tolist()):
            if calls:
                self._count_c(layer, calls, needed, missing, evicted, runs, copying, copy_ns * 1e-9, step_ns * 1e-9)
        self._acc[...] = 0

    def _count_c(self, layer: int, calls: int, needed: int, missing: int, evicted: int, runs: int, copying: int,
                 copy_seconds: float, seconds: float) -> None:
        """staging.c's counters of `calls` steps of `layer` (`copying` of them with a copy) into `stats`:
        one mapping for the host node's C step and the in-walk command's folded counters."""
        st = self._stats
        st.calls += calls
        st.selected += needed
        st.hits += needed - missing
        st.experts_staged += missing
        st.evictions += evicted
        st.copies += runs
        st.writes += copying * len(self._names[layer])
        st.bytes_staged += self._expert_bytes[layer] * missing
        st.copy_seconds += copy_seconds
        st.seconds += seconds

    def drain(self) -> None:
        """Settle a pending prefetch (before anything else reads the caches or counters): cancel
        it if not begun, drop the copies it has not started, wait for the one in flight."""
        if self._job is not None:
            self._settle(())

    def close(self) -> None:
        """Drain and stop the helper thread (idempotent); call before the caches are released."""
        self.drain()
        helper, self._helper = self._helper, None
        if helper is not None:
            assert self._stop_helper is not None
            self._stop_helper()               # queues the helper's stop (once)
            helper.join()
        self._jobs = self._stop_helper = None

    def reset_stats(self) -> None:
        self.drain()
        self._stats = StagingStats()
        self._acc[...] = 0
        self.records = []

    def resident(self, layer: int) -> dict[int, int]:
        """expert -> slot of a layer's cache right now (after settling a pending prefetch, so every
        slot listed holds its expert's bytes)."""
        self.drain()
        native = self._native_layers[layer]
        return native.slot_of if native is not None else dict(self._layers[layer].slot_of)

    # -- the host callback --------------------------------------------------------
    # the host step may hand this callback views of the graph's memory instead of copies
    # (`flare.core.host_calls`): it keeps none of its inputs (a prefetch job gets a copy of `hidden`)
    borrows_inputs = True
    fills_output = True                       # the slots are written into `out` when given

    def __call__(self, node: Any, ids: np.ndarray, rows: np.ndarray | None = None, hidden: np.ndarray | None = None,
                 *, ctx: Any, out: np.ndarray | None = None) -> np.ndarray:
        layer = int(node.params["args"]["layer"])
        ids = np.asarray(ids)
        valid = None
        # padding rows stage nothing; a decode step has none (a list test, no NumPy temporaries)
        if rows is not None:
            rows = np.asarray(rows)
            if self.scratch_row in rows.ravel().tolist():
                valid = rows.reshape(-1) != self.scratch_row
        out = self.stage(layer, ids, valid, ctx, out)
        if self.prefetch and hidden is not None and layer + 1 < self.n_layers:
            h = np.asarray(hidden)   # copied: the helper reads it after this call returns
            self._start_prefetch(layer + 1, h.copy() if valid is None else h[valid], ctx, queued_by_stage=True)
        return out

    def stage(self, layer: int, ids: np.ndarray, valid: np.ndarray | None, ctx: Any,
              out: np.ndarray | None = None) -> np.ndarray:
        """Make the experts in `ids` (rows of tokens where `valid`) resident; return their slots
        (written into `out`, of ids' shape, when given).

        The common case, every selected expert already resident (most decode steps), is a set
        of the ids, a membership test per expert, the use counts and one lookup in the layer's
        slot table: no eviction work, no copies."""
        # a layer the device's command list stages too keeps its records in C (one set of records)
        if (self.native and not self.prefetch) or self._walk[layer]:
            step = self._native_step(layer, ctx)
            if step is not None:
                return self._stage_native(layer, step, ids, valid, out)
        if self._native_layers[layer] is not None:   # staged in C before: those records are void here
            self.drain()                             # (a pending prefetch planned on the records replaced)
            self._native_layers[layer] = None
            self._layers[layer] = _LayerCache(self.slots, self.n_experts)
        t0 = time.perf_counter()
        chosen = ids if valid is None else ids[valid]
        needed = sorted(set(chosen.ravel().tolist()))
        taken_back = 0
        if self._job is not None:
            taken_back = self._settle(needed if self._job.layer == layer else (), ctx)
        cache = self._layers[layer]
        slot_of = cache.slot_of
        missing = [e for e in needed if e not in slot_of]
        prefetch_hits = 0
        if cache.unused_prefetch:
            prefetch_hits = len(cache.unused_prefetch.intersection(needed))
            cache.unused_prefetch.difference_update(needed)
        evicted: list[int] = []
        runs: list[Run] = []
        if missing:                          # (resident experts are in range and fit: checked when staged)
            if len(needed) > self.slots:
                raise ExpertCacheError(
                    f"{self.label}: layer {layer}: a step selects {len(needed)} distinct experts for "
                    f"{chosen.shape[0]} token(s), but the expert cache has {self.slots} slot(s) per layer")
            if missing[0] < 0 or missing[-1] >= self.n_experts:
                raise ExpertCacheError(f"{self.label}: layer {layer}: expert id out of range 0..{self.n_experts - 1}")
            victims = cache.victims(len(missing), set(needed))
            if len(victims) < len(missing):  # guarded by the slot check above; kept as a last line
                raise ExpertCacheError(f"{self.label}: layer {layer}: no slot to evict ({self.slots} slots)")
            evicted = [old for old in (cache.take(slot) for slot in victims) if old is not None]
            runs = _runs(missing, sorted(victims))
            cache.place(runs)
            self._copy(layer, runs, ctx)
        cache.use(needed)
        if out is not None and (out.dtype != cache.table.dtype or out.shape != ids.shape):
            out = None                         # a node declared otherwise: the host step casts and checks
        out = cache.table.take(ids, out=out)
        st = self._stats
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

    def _native_step(self, layer: int, ctx: Any) -> Any:
        """The device's C staging step for `layer` (`expert_stage_step`: caches in host memory,
        sources as contiguous bytes), or None: the Python path. Resolved once per ctx."""
        if ctx is not self._native_ctx:
            self._native_ctx, self._native_steps = ctx, []
        while len(self._native_steps) <= layer:
            i = len(self._native_steps)
            self._native_steps.append(self._make_native_step(i, ctx))
        bound = self._native_steps[layer]
        if bound is None:
            return None
        state = self._native_layers[layer]
        if state is None or bound.state is not state:
            # a new ctx keeps the layer's records (as the Python path does: `invalidate` forgets
            # them); a layer coming from the Python path starts empty (re-copies, same outputs)
            fresh = state is None
            if fresh:
                state = _NativeLayer(self.slots, self.n_experts)
            if not bound.bind(state):
                self._native_steps[layer] = None
                return None
            if fresh:
                self._layers[layer] = _LayerCache(self.slots, self.n_experts)
                self._native_layers[layer] = state
                for block in self._walk[layer]:
                    block.bind(state)
        return bound.step

    # -- inside the device's command list -------------------------------------------
    def runs_in_walk(self, node: Any, device: Any) -> bool:
        """Whether the `stage_experts` node may run inside `device`'s split (the partitioner's
        question): the device has the command (`stages_in_walk`), staging would take the C step
        (`native`, no prefetch) and no trace is kept (records are the host path's). Whether it
        does is settled when the split is compiled (`walk_command`: else the split calls this
        callback as a step of its own, same outputs)."""
        return self._walk_path() and bool(getattr(device, "stages_in_walk", False))

    def _walk_path(self) -> bool:
        """Whether staging may run inside a device's command list: the C step (`native`), no
        prefetch, no trace (records are the host path's), and `in_walk` not turned off."""
        return self.in_walk and self.native and not self.prefetch and not self.trace

    def walk_command(self, node: Any, ctx: Any, out: np.ndarray, srcs: Sequence[np.ndarray]) -> Any:
        """The device's staging command for this node's layer, bound to the layer's records (the
        ones the host path stages on too), or None."""
        if not self._walk_path():
            return None
        layer = int(node.params["args"]["layer"])
        if self._native_step(layer, ctx) is None:
            return None
        bound = self._native_steps[layer]
        make = getattr(bound.device, "expert_stage_command", None)
        if make is None:
            return None
        ids, rows = srcs[0], (srcs[1] if len(srcs) > 1 else None)
        made = make(bound.sources, bound.targets, self._acc[layer], AGE_EVERY,
                    lambda code: self._walk_error(layer, code, ids, rows), ids, rows, out, self.scratch_row)
        if made is None:
            return None
        command, block = made
        block.bind(self._native_layers[layer])
        self._walk[layer].add(block)
        return command

    def _walk_error(self, layer: int, code: int, ids: np.ndarray, rows: np.ndarray | None) -> ExpertCacheError:
        """The error of a staging command that failed inside the walk (staging.c's code; the
        step changed nothing), worded as the host path words it."""
        state = self._native_layers[layer]
        tokens = ids.shape[0] if rows is None else int(np.count_nonzero(np.asarray(rows) != self.scratch_row))
        return self._step_error(layer, code, int(state.info[0]) if state is not None else -1, tokens)

    def _step_error(self, layer: int, code: int, needed: int, tokens: int) -> ExpertCacheError:
        """staging.c's failure `code` as the error the Python path raises for the same step."""
        if code == 1:
            return ExpertCacheError(
                f"{self.label}: layer {layer}: a step selects {needed} distinct experts for "
                f"{tokens} token(s), but the expert cache has {self.slots} slot(s) per layer")
        if code == 2:
            return ExpertCacheError(f"{self.label}: layer {layer}: expert id out of range 0..{self.n_experts - 1}")
        return ExpertCacheError(f"{self.label}: layer {layer}: no slot to evict ({self.slots} slots)")

    def _make_native_step(self, layer: int, ctx: Any) -> Any:
        make_target = getattr(ctx, "row_byte_target", None)
        byte_sources = [_bytes_of(src) for src in self._sources[layer]]
        if make_target is None or any(b is None for b in byte_sources):
            return None
        try:
            targets = [make_target(name, like) for name, like in zip(self._names[layer], self._sources[layer])]
        except InputError:                     # not in host memory
            return None
        devices = {id(dev): dev for dev, _ in targets}
        make = getattr(next(iter(devices.values())), "expert_stage_step", None) if len(devices) == 1 else None
        if make is None:
            return None
        return _BoundStep(make, byte_sources, [target for _, target in targets], next(iter(devices.values())))

    def _stage_native(self, layer: int, step: Callable[..., int], ids: np.ndarray, valid: np.ndarray | None,
                      out: np.ndarray | None) -> np.ndarray:
        """`stage` by the device's C step: the same policy, on `_NativeLayer`'s arrays."""
        t0 = time.perf_counter()
        state = self._native_layers[layer]
        assert state is not None
        if ids.dtype != np.int32 or not ids.flags.c_contiguous:
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.n_experts):
                raise ExpertCacheError(f"{self.label}: layer {layer}: expert id out of range 0..{self.n_experts - 1}")
            ids = np.ascontiguousarray(ids, np.int32)
        if out is None or out.dtype != np.int32 or out.shape != ids.shape or not out.flags.c_contiguous \
                or not out.flags.writeable:
            out = np.empty(ids.shape, np.int32)
        flags = None if valid is None else np.ascontiguousarray(valid, np.bool_).view(np.uint8)
        code = step(ids, flags, out)
        info = state.info.tolist()
        if code:
            tokens = ids.shape[0] if valid is None else int(np.count_nonzero(valid))
            raise self._step_error(layer, code, info[0], tokens)
        needed, missing, evicted, runs = info[0], info[1], info[2], info[3]
        copying = int(missing > 0)
        self._count_c(layer, 1, needed, missing, evicted, runs * copying, copying, info[4] * 1e-9 * copying,
                      time.perf_counter() - t0)
        if self.trace:
            rec, s = state.record.tolist(), self.slots
            flat = rec[3 * s: 3 * s + 3 * runs]
            self.records.append(StageRecord(layer, tuple(rec[:needed]), tuple(rec[s: s + missing]),
                                            tuple(tuple(flat[i: i + 3]) for i in range(0, len(flat), 3)),
                                            tuple(rec[2 * s: 2 * s + evicted])))
        return out

    def _copy(self, layer: int, runs: list[Run], ctx: Any) -> None:
        """Copy `runs` of `layer` from the source into the caches (staging thread, inside the
        execute: the graph's lock is held, so its lock-free row writers are safe here too)."""
        t0 = time.perf_counter()
        host, writers = self._layer_writers(layer, ctx)
        for write_runs, src in writers:       # one call per tensor for all the runs
            write_runs(runs, src)
        self._stats.bytes_staged += self._expert_bytes[layer] * sum(count for _, _, count in runs)
        self._stats.copies += len(runs)
        self._stats.writes += len(writers) if host else len(runs) * len(writers)
        self._stats.copy_seconds += time.perf_counter() - t0

    # -- prefetch -------------------------------------------------------------------
    def prefetch_layer(self, layer: int, hidden: np.ndarray | Callable[[], np.ndarray], ctx: Any) -> None:
        """Start guessing and copying `layer`'s experts now from `hidden`, an estimate of the
        residual stream entering it ([T, D], padding rows left out; or a function the helper
        calls for it, so work such as dequantizing embedding rows leaves the caller's thread):
        a model calls it right before an execute, holding the graph (`PreparedGraph.hold()`),
        with the step's token embeddings, so layer 0, for which no earlier layer can guess, gets
        its copies started while the inputs are written and layer 0's attention runs. `ctx` is
        the prepared graph. No-op without prefetch."""
        if not self.prefetch or not 0 <= layer < self.n_layers:
            return
        self.drain()
        self._start_prefetch(layer, hidden, ctx)

    def _layer_writers(self, layer: int, ctx: Any) -> tuple[bool, tuple[tuple[RunWriter, np.ndarray], ...]]:
        """How `layer`'s caches are written: (in host memory, (runs writer, source) per tensor),
        a writer taking (first source row, slot, count) runs. Where the cache is in host memory,
        the graph's lock-free `row_byte_run_writer` fed the source's bytes (the helper's copies
        may outlive the execute that queued them; demand copies skip write_rows' guard and
        conversions, and a staging call's runs are one call per tensor), else `ctx.write_rows`
        per run fed the source as stored (caches on another device, whose writes prefetch never
        makes; tests and the reference ctx, which have no row writers)."""
        if ctx is not self._writer_ctx:
            self._writer_ctx, self._writers = ctx, []
        while len(self._writers) <= layer:
            i = len(self._writers)
            make = getattr(ctx, "row_byte_run_writer", None)
            byte_sources = [_bytes_of(src) for src in self._sources[i]]
            try:
                if make is None or any(b is None for b in byte_sources):
                    raise InputError("no row_byte_run_writer")
                entry = (True, tuple((make(name, like), src) for name, like, src
                                     in zip(self._names[i], self._sources[i], byte_sources)))
            except InputError:                # not in host memory: the guarded write, a run at a time
                entry = (False, tuple((_guarded_run_writer(ctx, name), src)
                                      for name, src in zip(self._names[i], self._sources[i])))
            self._writers.append(entry)
        return self._writers[layer]

    def _start_prefetch(self, layer: int, hidden: np.ndarray | Callable[[], np.ndarray], ctx: Any,
                        queued_by_stage: bool = False) -> None:
        """Queue the guess-and-copy of `layer` for the helper thread (started on first use)."""
        if self._helper is None:
            # the thread holds only the queue, so a stager dropped without close() is collected,
            # and its finalizer stops the thread
            self._jobs = jobs = queue.SimpleQueue()
            self._helper = threading.Thread(target=_helper_loop, args=(jobs,),
                                            name=f"{self.label}-expert-prefetch", daemon=True)
            self._helper.start()
            self._stop_helper = weakref.finalize(self, jobs.put, None)
        job = _PrefetchJob(self, layer, hidden, self._layer_writers(layer, ctx)[1])
        if queued_by_stage and self.trace and self.records:
            job.record = len(self.records) - 1
        self._job = job
        assert self._jobs is not None
        self._jobs.put(job)

    def _run_job(self, job: _PrefetchJob) -> None:
        """The helper thread: guess, pick slots, then copy run by run until the job is taken back."""
        with job.cond:
            if job.state == CANCELLED:
                return
            job.state = PLANNING
        t0 = time.perf_counter()
        try:
            hidden = job.hidden() if callable(job.hidden) else job.hidden
            job.guessed, job.runs = self._plan(job.layer, np.asarray(hidden)) if np.size(hidden) else ((), [])
        except BaseException as exc:          # handed to the staging thread by _settle
            job.error = exc
        with job.cond:
            job.state = COPYING
            job.cond.notify_all()
        while job.error is None:
            with job.cond:
                if job.next >= len(job.runs):
                    break
                run = job.runs[job.next]
                job.next += 1
                job.busy = True
            try:
                for write_runs, src in job.writers:
                    write_runs([run], src)
                job.copied.append(run)
            except BaseException as exc:
                job.error = exc
            finally:
                with job.cond:
                    job.busy = False
                    job.cond.notify_all()
        job.seconds = time.perf_counter() - t0
        with job.cond:
            job.state = DONE
            job.stager = None                  # type: ignore[assignment]  # no reference once done
            job.cond.notify_all()

    def _plan(self, layer: int, hidden: np.ndarray) -> tuple[tuple[int, ...], list[Run]]:
        """Guess `layer`'s experts from the residual stream and give them slots (helper thread)."""
        weight_t, bias = self._routers[layer]
        x = hidden.reshape(-1, weight_t.shape[0]).astype(np.float32, copy=False)
        logits = x @ weight_t                  # the RMS norm's weight is folded into the router
        if bias is not None:
            # the norm's 1/rms(x) scales each token's logits: it changes their order only with a
            # bias (without one the top n are the same, and the norm is skipped: the guess is
            # Python holding the GIL, which the compute thread waits for when it leaves C)
            logits *= (1.0 / np.sqrt(np.einsum("ij,ij->i", x, x) / x.shape[1] + 1e-6))[:, None]
            logits += bias
        n = min(self.prefetch, self.n_experts)
        if n == 1:
            guess = sorted(set(logits.argmax(axis=-1).tolist()))
        else:
            top = np.argpartition(-logits, n - 1, axis=-1)[:, :n] if n < self.n_experts else np.argsort(-logits, -1)
            guess = sorted(set(top.ravel().tolist()))
        cache = self._layers[layer]
        missing = [e for e in guess if e not in cache.slot_of][: self.slots]
        victims = cache.victims(len(missing), set(guess)) if missing else []
        missing = missing[: len(victims)]
        if not missing:
            return (), []
        for slot in victims:
            cache.take(slot)
        runs = _runs(missing, sorted(victims))
        cache.place(runs)
        cache.unused_prefetch.update(missing)
        return tuple(missing), runs

    def _settle(self, needed: Sequence[int], ctx: Any = None) -> int:
        """End the pending job (staging thread): cancel it if not begun, else wait for its plan,
        take back its unstarted runs and wait for the run in flight; copy the taken-back experts
        in `needed` here (with `ctx`), free the slots of the others; count what the helper did.
        Returns how many experts it copied here."""
        job, self._job = self._job, None
        assert job is not None
        with job.cond:
            if job.state == QUEUED and self.take_back:
                job.state = CANCELLED
                return 0
            t0 = time.perf_counter()
            if not self.take_back:
                job.cond.wait_for(lambda: job.state == DONE)
            job.cond.wait_for(lambda: job.state != PLANNING)
            rest, job.next = job.runs[job.next:], len(job.runs)
            job.cond.wait_for(lambda: not job.busy)
            self._stats.prefetch_wait_seconds += time.perf_counter() - t0
        if job.error is not None:             # the layer's records may be half-updated: forget them all
            self._layers[job.layer] = _LayerCache(self.slots, self.n_experts)
            raise job.error
        if job.record is not None and job.guessed and job.record < len(self.records):
            last = self.records[job.record]
            self.records[job.record] = StageRecord(last.layer, last.selected, last.staged, last.runs, last.evicted,
                                                   job.guessed)
        cache = self._layers[job.layer]
        copied = job.copied
        st = self._stats
        st.prefetched += sum(n for _, _, n in copied)
        st.copies += len(copied)
        st.writes += len(copied) * len(self._names[job.layer])
        st.bytes_staged += self._expert_bytes[job.layer] * sum(n for _, _, n in copied)
        st.prefetch_seconds += job.seconds
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
        return len(mine)


def release_staged(graph: Any, stager: "ExpertStager | None", close_session: Callable[[], None] | None = None) -> None:
    """Release a prepared graph whose expert cache `stager` fills, in the one safe order: wait for
    the stager's copies in flight, release the graph, stop the prefetch thread (no background copy
    may outlive the cache buffers), close the session if the model owns it, then forget the
    stager's slot records. The last three run even when releasing the graph fails."""
    try:
        if stager is not None:
            stager.drain()
        graph.release()
    finally:
        if stager is not None:
            stager.close()
        if close_session is not None:
            close_session()
        if stager is not None:
            stager.invalidate()


def _helper_loop(jobs: queue.SimpleQueue) -> None:
    """The helper thread: run queued jobs until a None (close(), or the stager's finalizer)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        stager = job.stager
        if stager is not None:
            stager._run_job(job)
        job = stager = None                    # hold nothing while waiting


def _guarded_run_writer(ctx: Any, name: str) -> RunWriter:
    """A runs writer over `ctx.write_rows` (its checks and conversions, and its lock): one call per run."""
    def write(runs: Sequence[Run], source: np.ndarray) -> None:
        for first, slot, count in runs:
            ctx.write_rows(name, slot, source[first: first + count])
    return write


def _bytes_of(source: np.ndarray) -> np.ndarray | None:
    """The experts of `source` [E, ...] as their bytes, uint8 [E, bytes per expert] (a view; None
    where the rows are not contiguous)."""
    if not source.flags.c_contiguous or source.ndim == 0 or source.shape[0] == 0:
        return None
    return source.reshape(source.shape[0], -1).view(np.uint8)


def _runs(experts: list[int], slots: list[int]) -> list[Run]:
    """Pair sorted experts with sorted slots; merge where both are consecutive."""
    runs: list[Run] = []
    for e, s in zip(sorted(experts), slots):
        if runs and e == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((e, s, 1))
    return runs


class _BoundStep:
    """A device's `expert_stage_step` factory with one layer's sources and cache targets, bound
    to that layer's `_NativeLayer` on first use (again when the layer's records start over)."""

    def __init__(self, make: Callable[..., Any], sources: list[np.ndarray], targets: list[Callable[[], np.ndarray]],
                 device: Any = None):
        self._make, self.sources, self.targets, self.device = make, sources, targets, device
        # step(ids int32 [T, k], valid uint8 [T] | None, out int32 [T, k]) -> staging.c's code
        self.step: Callable[[np.ndarray, np.ndarray | None, np.ndarray], int] | None = None
        self.state: _NativeLayer | None = None

    def bind(self, state: _NativeLayer) -> bool:
        """Bind to `state`; False where the device has no C step after all (no native executor)."""
        self.step = self._make(state, self.sources, self.targets, AGE_EVERY)
        self.state = state if self.step is not None else None
        return self.step is not None
