"""Expert staging: the host callback that makes a step's experts resident in the cache.

The graph's `stage_experts` host node hands it the router's choices `ids`
[tokens, 2]. It copies every selected expert that is not yet in the cache from
host memory into a free slot, or into the least recently used slot whose
expert this step does not need, and returns the slot of each choice. One
expert occupies at most one slot, so `mul_mat_id` groups tokens exactly as it
does with expert ids and the outputs equal the resident graph's.

The cache is a `cache` tensor: it survives `reset()` (it is not per-request
state), so the slot table here stays true across requests. The runtime makes
one stager per prepared model (it calls the ModelSpec's `stage_experts`
factory in `Session.prepare_model`), so two prepared models never share one.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from flare.core.errors import ModelError

from .model import EXPERT_TENSORS, N_EXPERTS, TOP_K, TinyConfig


class ExpertCacheError(ModelError):
    """A step needs more distinct experts at once than the cache has slots."""


@dataclass
class StagingStats:
    calls: int = 0
    hits: int = 0         # selected experts already in the cache
    staged: int = 0       # experts copied from host memory
    evictions: int = 0


class ExpertStager:
    """`stager(node, ids, ctx=prepared_graph) -> slots`: the `stage_experts` host callback."""

    def __init__(self, cfg: TinyConfig, experts: Mapping[str, np.ndarray]):
        need = min(N_EXPERTS, cfg.tokens * TOP_K)
        if cfg.slots < need:
            raise ExpertCacheError(
                f"tiny-moe: slots={cfg.slots} cannot hold the {need} experts a step of tokens={cfg.tokens} "
                f"may select (top {TOP_K} of {N_EXPERTS} per token); use slots >= {need} or experts=resident")
        self.n_slots = cfg.slots
        self.experts = {name: experts[name] for name in EXPERT_TENSORS}   # host arrays [16, ...]
        self.expert_in: list[int | None] = [None] * cfg.slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()             # expert -> slot, oldest use first
        self.stats = StagingStats()

    def __call__(self, node: Any, ids: np.ndarray, *, ctx: Any) -> np.ndarray:
        selected = [int(e) for e in np.unique(ids)]
        if len(selected) > self.n_slots:
            raise ExpertCacheError(
                f"tiny-moe: node {node.name!r} selected {len(selected)} experts ({selected}) in one step "
                f"of {ids.shape[0]} tokens, but the cache has {self.n_slots} slots")
        self.stats.calls += 1
        for e in selected:
            if e in self.slot_of:
                self.stats.hits += 1
                self.slot_of.move_to_end(e)
        for e in selected:
            if e not in self.slot_of:
                slot = self._free_slot()
                for name, host in self.experts.items():
                    ctx.write_rows(name, slot, host[e:e + 1])   # rows of a cache tensor = its slots
                self.expert_in[slot] = e
                self.slot_of[e] = slot
                self.stats.staged += 1
        table = np.zeros(N_EXPERTS, np.int32)
        for e, slot in self.slot_of.items():
            table[e] = slot
        return table[ids]

    def _free_slot(self) -> int:
        """An empty slot, else the least recently used one (never one this step selected:
        those were moved to the end, and a step selects at most n_slots experts)."""
        for slot, expert in enumerate(self.expert_in):
            if expert is None:
                return slot
        victim, slot = next(iter(self.slot_of.items()))
        del self.slot_of[victim]
        self.stats.evictions += 1
        return slot
