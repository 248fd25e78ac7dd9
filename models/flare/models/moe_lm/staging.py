"""Expert staging: make exactly the experts a step selected resident in a bounded cache.

In `offload` mode each layer owns three `cache` tensors (gate, up, down) of S
expert slots on the device. The graph calls `ExpertStager` as a `host` node
between the router's top-k and the expert matmuls: it reads the selected ids,
copies the missing experts from the source (a memory-mapped file or host
memory) into free or least-recently-used slots, and returns the slot of every
(token, choice) so `mul_mat_id` indexes the cache instead of all experts.

Rules that keep outputs identical to `resident` mode:
- an expert needed by the current step is never evicted, and a step needing
  more experts than there are slots is an error (checked at prepare time for
  the largest planned step, and again at run time);
- one expert occupies at most one slot, so the matmul groups tokens exactly as
  it does with expert ids.
Consecutive missing experts going to consecutive slots are copied with one
write per tensor (one "copy"), since the source stores experts contiguously.

Optional prefetch (`prefetch=n`): after staging layer i, the stager guesses
layer i+1's experts by applying layer i+1's router to layer i's FFN input
(the residual stream changes little in one layer) and copies the guessed
experts on a background thread while the device computes. Layer i+1's
staging call waits for that copy first, then proceeds as always, so outputs
do not change; only the copy time moves off the critical path. It is off by
default and only safe where the cache lives in host-addressable memory (CPU).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from flare.core.errors import ModelError

from .config import MoeConfig
from .weights import EXPERT_PARTS, expert_name

MIB = 1 << 20


class ExpertCacheError(ModelError):
    """The expert cache cannot hold the experts one step of one layer may need."""


def slots_for_budget(cfg: MoeConfig, cache_mb: float | None, max_step_tokens: int) -> int:
    """Slots per layer that `cache_mb` MiB (all layers together) buys; rejects a budget
    that cannot hold one layer's active experts for a step of `max_step_tokens` tokens."""
    need = cfg.slots_needed(max_step_tokens)
    if cache_mb is None:
        slots = max(need, int(round(cfg.n_experts * cfg.default_cache_fraction)))
    else:
        slots = int(cache_mb * MIB) // (cfg.n_layers * cfg.expert_bytes)
    slots = min(slots, cfg.n_experts)
    if slots < need:
        given = f"{cache_mb:g} MiB" if cache_mb is not None else "the default budget"
        raise ExpertCacheError(
            f"moe-lm {cfg.name}: expert cache of {given} holds {slots} expert(s) per layer "
            f"({cfg.n_layers} layers x {cfg.expert_bytes} B per expert); a step of {max_step_tokens} token(s) with "
            f"top_k={cfg.top_k} may need {need} experts of one layer resident at once, i.e. at least "
            f"{need * cfg.n_layers * cfg.expert_bytes / MIB:.2f} MiB (--expert-cache-mb)")
    return slots


@dataclass
class StagingStats:
    """Counters since the last `reset_stats()`. `copies` counts merged runs and `writes` write_rows
    calls; both, and `bytes_staged`, include prefetch copies. `experts_staged` is demand misses only."""

    calls: int = 0
    selected: int = 0
    hits: int = 0
    experts_staged: int = 0
    copies: int = 0
    writes: int = 0
    bytes_staged: int = 0
    evictions: int = 0
    seconds: float = 0.0
    prefetched: int = 0        # experts copied ahead of time by the prefetch thread
    prefetch_hits: int = 0     # selected experts that were resident only thanks to a prefetch
    prefetch_seconds: float = 0.0
    prefetch_wait_seconds: float = 0.0

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
    prefetched: tuple[int, ...] = ()  # experts of layer+1 copied ahead by the prefetch thread


class _LayerCache:
    def __init__(self, slots: int):
        self.expert_in: list[int | None] = [None] * slots
        self.slot_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.unused_prefetch: set[int] = set()

    def take(self, slot: int) -> int | None:
        """Empty `slot`; returns the expert it held."""
        old = self.expert_in[slot]
        if old is not None:
            del self.slot_of[old]
            del self.lru[old]
            self.unused_prefetch.discard(old)
            self.expert_in[slot] = None
        return old

    def put(self, expert: int, slot: int) -> None:
        self.expert_in[slot] = expert
        self.slot_of[expert] = slot
        self.lru[expert] = None


class ExpertStager:
    """The `stage_experts` host callback of one loaded model (see the module docstring)."""

    def __init__(self, cfg: MoeConfig, source: Mapping[str, np.ndarray], slots: int, *, trace: bool = False,
                 prefetch: int = 0, routers: Mapping[str, np.ndarray] | None = None):
        missing = [expert_name(i, p) for i in range(cfg.n_layers) for p in EXPERT_PARTS
                   if expert_name(i, p) not in source]
        if missing:
            raise ModelError(f"moe-lm: expert source lacks {', '.join(missing)}")
        self.cfg = cfg
        self.slots = int(slots)
        self.source = source
        self.trace = trace
        self.records: list[StageRecord] = []
        self.stats = StagingStats()
        self._layers = [_LayerCache(self.slots) for _ in range(cfg.n_layers)]
        self.prefetch = int(prefetch)
        self._routers: list[tuple[np.ndarray, np.ndarray]] = []
        if self.prefetch:
            if routers is None:
                raise ModelError("moe-lm: expert prefetch needs the router weights")
            self.set_routers(routers)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def set_routers(self, routers: Mapping[str, np.ndarray]) -> None:
        """Router weights used to guess the next layer's experts (prefetch)."""
        self._routers = [(np.array(routers[f"L{i}.router"], np.float32),
                          np.array(routers[f"L{i}.router_bias"], np.float32)) for i in range(self.cfg.n_layers)]

    def invalidate(self) -> None:
        """Forget what the device caches hold (a new PreparedGraph starts empty)."""
        self.drain()
        self._layers = [_LayerCache(self.slots) for _ in range(self.cfg.n_layers)]

    def drain(self) -> None:
        """Wait for a background prefetch copy (before anything else touches the caches)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            t0 = time.perf_counter()
            try:
                pending.result()
            finally:
                self.stats.prefetch_wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Drain and stop the prefetch thread (idempotent)."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def reset_stats(self) -> None:
        self.stats = StagingStats()
        self.records = []

    def resident(self, layer: int) -> dict[int, int]:
        """expert -> slot of a layer's cache right now."""
        return dict(self._layers[layer].slot_of)

    # -- the host callback --------------------------------------------------------
    def __call__(self, node: Any, ids: np.ndarray, rows: np.ndarray | None = None, hidden: np.ndarray | None = None,
                 *, ctx: Any) -> np.ndarray:
        layer = int(node.params["args"]["layer"])
        valid = None if rows is None else (np.asarray(rows).reshape(-1) != self.cfg.scratch_row)
        out = self.stage(layer, np.asarray(ids), valid, ctx)
        if self.prefetch and hidden is not None and layer + 1 < self.cfg.n_layers:
            self._prefetch(layer + 1, np.asarray(hidden) if valid is None else np.asarray(hidden)[valid], ctx)
        return out

    def stage(self, layer: int, ids: np.ndarray, valid: np.ndarray | None, ctx: Any) -> np.ndarray:
        """Make the experts in `ids` (rows of tokens where `valid`) resident; return their slots."""
        self.drain()
        t0 = time.perf_counter()
        cache = self._layers[layer]
        chosen = ids if valid is None else ids[valid]
        needed = [int(e) for e in np.unique(chosen)]
        if len(needed) > self.slots:
            raise ExpertCacheError(
                f"moe-lm: layer {layer} step selects {len(needed)} distinct experts for {ids.shape[0]} token(s), "
                f"but the expert cache has {self.slots} slot(s) per layer")
        missing = [e for e in needed if e not in cache.slot_of]
        prefetch_hits = len(cache.unused_prefetch.intersection(needed))
        cache.unused_prefetch.difference_update(needed)
        need_set = set(needed)
        victims = self._victims(cache, len(missing), need_set)
        evicted = [old for old in (cache.take(slot) for slot in victims) if old is not None]
        runs = _runs(missing, sorted(victims))
        self.stats.writes += self._copy(layer, runs, ctx)
        for first, slot, count in runs:
            for j in range(count):
                cache.put(first + j, slot + j)
        for e in needed:
            cache.lru[e] = None
            cache.lru.move_to_end(e)
        table = np.zeros(self.cfg.n_experts, np.int32)
        for e, s in cache.slot_of.items():
            table[e] = s
        out = table[ids]
        st = self.stats
        st.calls += 1
        st.selected += len(needed)
        st.hits += len(needed) - len(missing)
        st.experts_staged += len(missing)
        st.copies += len(runs)
        st.bytes_staged += len(missing) * self.cfg.expert_bytes
        st.evictions += len(evicted)
        st.prefetch_hits += prefetch_hits
        st.seconds += time.perf_counter() - t0
        if self.trace:
            self.records.append(StageRecord(layer, tuple(needed), tuple(missing), tuple(runs), tuple(evicted)))
        return out

    def _copy(self, layer: int, runs: list[tuple[int, int, int]], ctx: Any) -> int:
        writes = 0
        for first, slot, count in runs:
            for part in EXPERT_PARTS:
                name = expert_name(layer, part)
                ctx.write_rows(name, slot, self.source[name][first: first + count])
                writes += 1
        return writes

    def _prefetch(self, layer: int, hidden: np.ndarray, ctx: Any) -> None:
        """Guess `layer`'s experts from the previous layer's FFN input; copy them in the background."""
        if hidden.size == 0:
            return
        weight, bias = self._routers[layer]
        logits = hidden.reshape(-1, weight.shape[1]).astype(np.float32) @ weight.T + bias
        guess = np.unique(np.argsort(-logits, axis=-1, kind="stable")[:, : self.prefetch])
        cache = self._layers[layer]
        protect = set(int(e) for e in guess)
        missing = [int(e) for e in guess if int(e) not in cache.slot_of][: self.slots]
        if not missing:
            return
        victims = self._victims(cache, len(missing), protect, strict=False)
        missing = missing[: len(victims)]
        for slot in victims:
            cache.take(slot)
        runs = _runs(missing, sorted(victims))
        for first, slot, count in runs:
            for j in range(count):
                cache.put(first + j, slot + j)
                cache.unused_prefetch.add(first + j)
        self.stats.prefetched += len(missing)
        self.stats.bytes_staged += len(missing) * self.cfg.expert_bytes
        self.stats.copies += len(runs)
        self.stats.writes += 3 * len(runs)
        if self.trace and self.records:
            last = self.records[-1]
            self.records[-1] = StageRecord(last.layer, last.selected, last.staged, last.runs, last.evicted,
                                           tuple(missing))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-prefetch")
        self._pending = self._pool.submit(self._timed_copy, layer, runs, ctx)

    def _timed_copy(self, layer: int, runs: list[tuple[int, int, int]], ctx: Any) -> None:
        t0 = time.perf_counter()
        self._copy(layer, runs, ctx)
        self.stats.prefetch_seconds += time.perf_counter() - t0

    @staticmethod
    def _victims(cache: _LayerCache, count: int, needed: set[int], strict: bool = True) -> list[int]:
        """`count` slots to fill: free slots first, then least recently used experts not needed now
        (fewer when not `strict`)."""
        if count == 0:
            return []
        free = [s for s, e in enumerate(cache.expert_in) if e is None]
        out = free[:count]
        if len(out) < count:
            for e in cache.lru:  # oldest first
                if e not in needed:
                    out.append(cache.slot_of[e])
                    if len(out) == count:
                        break
        if len(out) < count and strict:  # guarded by the slot check in stage(); kept as a last line
            raise ExpertCacheError(f"moe-lm: expert cache has no slot to evict ({len(cache.expert_in)} slots, "
                                   f"{len(needed)} experts needed now)")
        return out


def _runs(experts: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """Pair sorted experts with sorted slots; merge where both are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for e, s in zip(sorted(experts), slots):
        if runs:
            fe, fs, n = runs[-1]
            if e == fe + n and s == fs + n:
                runs[-1] = (fe, fs, n + 1)
                continue
        runs.append((e, s, 1))
    return runs
