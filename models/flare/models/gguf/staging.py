"""Expert staging straight from the GGUF file: no conversion step.

In `offload` mode each MoE layer owns three `cache` tensors (gate, up, down)
of S expert slots, in the file's own quantized dtype. The graph calls
`FileExpertStager` as a host node between the router's top-k and the expert
matmuls; it copies the selected experts that are not resident from the
memory-mapped `ffn_*_exps` tensors (rows of blocks, exactly as stored) into
free or least-recently-used slots and returns each (token, choice)'s slot,
so `mul_mat_id` indexes the cache instead of all experts.

What keeps outputs identical to resident experts: an expert the current step
needs is never evicted, one expert holds at most one slot, and a step
needing more experts than slots is an error (checked before the step).
Consecutive experts bound for consecutive slots are copied with one write.
One stager belongs to one prepared graph; its calls come from that graph's
executes, which take turns on the graph's lock, so it holds no lock itself.

Prefetch (`prefetch=n`): after staging layer i, the stager guesses layer
i+1's experts by applying layer i+1's router to layer i's FFN input (the
residual stream changes little in one layer), taking each token's top n, and
copies the missing ones on a background thread while layer i computes. Layer
i+1's staging call first waits for that copy, then stages as always, so
outputs never change; only copy time leaves the critical path. The copy
writes the caches from another thread, which only host-memory (CPU) caches
allow; `GgufLM.load` refuses prefetch elsewhere.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from flare.core.errors import ModelError

from .config import LMConfig
from .graph import EXPERT_PARTS, expert_tensor


@dataclass
class StagingStats:
    calls: int = 0
    selected: int = 0
    hits: int = 0
    experts_staged: int = 0
    writes: int = 0
    bytes_staged: int = 0
    evictions: int = 0
    seconds: float = 0.0
    prefetched: int = 0             # experts copied ahead by the background thread
    prefetch_hits: int = 0          # selected experts resident only thanks to a prefetch
    prefetch_wait_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "hit_rate": self.hits / self.selected if self.selected else 1.0}


class _LayerCache:
    def __init__(self, slots: int):
        self.expert_in: list[int | None] = [None] * slots
        self.slot_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()   # oldest first
        self.unused_prefetch: set[int] = set()

    def take(self, slot: int) -> int | None:
        old = self.expert_in[slot]
        if old is not None:
            del self.slot_of[old], self.lru[old]
            self.unused_prefetch.discard(old)
            self.expert_in[slot] = None
        return old

    def victims(self, count: int, keep: set[int]) -> list[int]:
        """Up to `count` slots: free ones first, then least recently used experts not in `keep`."""
        out = [s for s, e in enumerate(self.expert_in) if e is None][:count]
        for e in self.lru:                                  # oldest first
            if len(out) == count:
                break
            if e not in keep:
                out.append(self.slot_of[e])
        return out


class FileExpertStager:
    """The `stage_experts` host callback of one prepared GGUF MoE model."""

    def __init__(self, cfg: LMConfig, tensor: Callable[[str], np.ndarray], slots: int, prefetch: int = 0):
        self.cfg = cfg
        self.slots = int(slots)
        self.tensor = tensor            # name -> view into the mapped file
        self.stats = StagingStats()
        self._layers = [_LayerCache(self.slots) for _ in range(cfg.n_layers)]
        self.prefetch = int(prefetch)
        self._routers = ([np.asarray(tensor(f"blk.{i}.ffn_gate_inp.weight"), np.float32)
                          for i in range(cfg.n_layers)] if self.prefetch else [])
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def invalidate(self) -> None:
        """Forget what the caches hold (a new prepared graph starts empty)."""
        self.drain()
        self._layers = [_LayerCache(self.slots) for _ in range(self.cfg.n_layers)]

    def drain(self) -> None:
        """Wait for a background copy (before anything else touches the caches)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            t0 = time.perf_counter()
            try:
                pending.result()
            finally:
                self.stats.prefetch_wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Drain and stop the prefetch thread (idempotent); before the caches are released."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def resident(self, layer: int) -> dict[int, int]:
        return dict(self._layers[layer].slot_of)

    def __call__(self, node: Any, ids: np.ndarray, rows: np.ndarray | None = None, hidden: np.ndarray | None = None,
                 *, ctx: Any) -> np.ndarray:
        layer = int(node.params["args"]["layer"])
        ids = np.asarray(ids)
        valid = None if rows is None else (np.asarray(rows).reshape(-1) != self.cfg.scratch_row)
        self.drain()
        t0 = time.perf_counter()
        cache = self._layers[layer]
        needed = [int(e) for e in np.unique(ids if valid is None else ids[valid])]
        if len(needed) > self.slots:
            raise ModelError(f"layer {layer}: a step selects {len(needed)} experts; the expert cache has "
                             f"{self.slots} slot(s) per layer")
        missing = [e for e in needed if e not in cache.slot_of]
        self.stats.prefetch_hits += len(cache.unused_prefetch.intersection(needed))
        cache.unused_prefetch.difference_update(needed)
        victims = cache.victims(len(missing), set(needed))
        evicted = sum(cache.take(slot) is not None for slot in victims)
        runs = _runs(missing, sorted(victims))
        self._place(cache, runs)
        self._copy(layer, runs, ctx)
        for e in needed:
            cache.lru.move_to_end(e)
        table = np.zeros(self.cfg.n_experts, np.int32)
        for e, s in cache.slot_of.items():
            table[e] = s
        st = self.stats
        st.calls += 1
        st.selected += len(needed)
        st.hits += len(needed) - len(missing)
        st.experts_staged += len(missing)
        st.evictions += evicted
        st.seconds += time.perf_counter() - t0
        if self.prefetch and hidden is not None and layer + 1 < self.cfg.n_layers:
            h = np.asarray(hidden)
            self._prefetch(layer + 1, h if valid is None else h[valid], ctx)
        return table[ids]

    @staticmethod
    def _place(cache: _LayerCache, runs: list[tuple[int, int, int]]) -> None:
        for first, slot, count in runs:
            for j in range(count):
                cache.expert_in[slot + j] = first + j
                cache.slot_of[first + j] = slot + j
                cache.lru[first + j] = None

    def _copy(self, layer: int, runs: list[tuple[int, int, int]], ctx: Any) -> None:
        for first, slot, count in runs:
            for part in EXPERT_PARTS:
                name = expert_tensor(layer, part)
                src = self.tensor(name)[first: first + count]
                ctx.write_rows(name, slot, src)
                self.stats.writes += 1
                self.stats.bytes_staged += int(src.nbytes)

    def _prefetch(self, layer: int, hidden: np.ndarray, ctx: Any) -> None:
        """Guess `layer`'s experts from the previous layer's FFN input; copy them in the background."""
        if hidden.size == 0:
            return
        logits = hidden.reshape(-1, self.cfg.d_model).astype(np.float32) @ self._routers[layer].T
        guess = [int(e) for e in np.unique(np.argsort(-logits, axis=-1, kind="stable")[:, : self.prefetch])]
        cache = self._layers[layer]
        missing = [e for e in guess if e not in cache.slot_of][: self.slots]
        victims = cache.victims(len(missing), set(guess))
        missing = missing[: len(victims)]
        if not missing:
            return
        for slot in victims:
            cache.take(slot)
        runs = _runs(missing, sorted(victims))
        self._place(cache, runs)
        cache.unused_prefetch.update(missing)
        self.stats.prefetched += len(missing)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-prefetch")
        self._pending = self._pool.submit(self._copy, layer, runs, ctx)


def _runs(experts: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """Pair sorted experts with sorted slots; merge where both are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for e, s in zip(sorted(experts), slots):
        if runs and e == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((e, s, 1))
    return runs
