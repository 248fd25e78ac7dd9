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
"""
from __future__ import annotations

import time
from collections import OrderedDict
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

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "hit_rate": self.hits / self.selected if self.selected else 1.0}


class _LayerCache:
    def __init__(self, slots: int):
        self.expert_in: list[int | None] = [None] * slots
        self.slot_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()   # oldest first


class FileExpertStager:
    """The `stage_experts` host callback of one prepared GGUF MoE model."""

    def __init__(self, cfg: LMConfig, tensor: Callable[[str], np.ndarray], slots: int):
        self.cfg = cfg
        self.slots = int(slots)
        self.tensor = tensor            # name -> view into the mapped file
        self.stats = StagingStats()
        self._layers = [_LayerCache(self.slots) for _ in range(cfg.n_layers)]

    def invalidate(self) -> None:
        """Forget what the caches hold (a new prepared graph starts empty)."""
        self._layers = [_LayerCache(self.slots) for _ in range(self.cfg.n_layers)]

    def resident(self, layer: int) -> dict[int, int]:
        return dict(self._layers[layer].slot_of)

    def __call__(self, node: Any, ids: np.ndarray, rows: np.ndarray | None = None, hidden: np.ndarray | None = None,
                 *, ctx: Any) -> np.ndarray:
        layer = int(node.params["args"]["layer"])
        ids = np.asarray(ids)
        valid = None if rows is None else (np.asarray(rows).reshape(-1) != self.cfg.scratch_row)
        t0 = time.perf_counter()
        cache = self._layers[layer]
        needed = [int(e) for e in np.unique(ids if valid is None else ids[valid])]
        if len(needed) > self.slots:
            raise ModelError(f"layer {layer}: a step selects {len(needed)} experts; the expert cache has "
                             f"{self.slots} slot(s) per layer")
        missing = [e for e in needed if e not in cache.slot_of]
        keep = set(needed)
        free = [s for s, e in enumerate(cache.expert_in) if e is None]
        victims = free[: len(missing)]
        for e in cache.lru:                                  # oldest first, never one needed now
            if len(victims) == len(missing):
                break
            if e not in keep:
                victims.append(cache.slot_of[e])
        evicted = 0
        for slot in victims:
            old = cache.expert_in[slot]
            if old is not None:
                del cache.slot_of[old], cache.lru[old]
                cache.expert_in[slot] = None
                evicted += 1
        for first, slot, count in _runs(missing, sorted(victims)):
            for part in EXPERT_PARTS:
                name = expert_tensor(layer, part)
                src = self.tensor(name)[first: first + count]
                ctx.write_rows(name, slot, src)
                self.stats.writes += 1
                self.stats.bytes_staged += int(src.nbytes)
            for j in range(count):
                cache.expert_in[slot + j] = first + j
                cache.slot_of[first + j] = slot + j
                cache.lru[first + j] = None
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
        return table[ids]


def _runs(experts: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """Pair sorted experts with sorted slots; merge where both are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for e, s in zip(sorted(experts), slots):
        if runs and e == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((e, s, 1))
    return runs
