"""moe-lm's expert staging: the shared `flare.core.expert_staging.ExpertStager` over its weight file.

In `offload` mode each layer owns three `cache` tensors `L{i}.experts.{gate,up,down}`
of S expert slots; the graph's `L{i}.expert.stage` host node calls the stager,
which copies the selected experts from the memory-mapped safetensors file (or a
host copy) into the slots and returns each choice's slot (rules, eviction and
prefetch: see `flare.core.expert_staging`). This module adds what is moe-lm's
own: the names of its tensors, its router (with a bias) and the budget check.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from flare.core.errors import ModelError
from flare.core.expert_staging import ExpertCacheError, StageRecord, StagingStats
from flare.core.expert_staging import ExpertStager as _SharedStager

from .config import MoeConfig
from .weights import EXPERT_PARTS, expert_name

__all__ = ["ExpertCacheError", "ExpertStager", "StageRecord", "StagingStats", "slots_for_budget"]

MIB = 1 << 20


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


class ExpertStager(_SharedStager):
    """The shared stager over moe-lm's expert tensors `L{i}.experts.{gate,up,down}` in `source`."""

    def __init__(self, cfg: MoeConfig, source: Mapping[str, np.ndarray], slots: int, *, trace: bool = False,
                 prefetch: int = 0, routers: Mapping[str, np.ndarray] | None = None):
        missing = [expert_name(i, p) for i in range(cfg.n_layers) for p in EXPERT_PARTS
                   if expert_name(i, p) not in source]
        if missing:
            raise ModelError(f"moe-lm: expert source lacks {', '.join(missing)}")
        self.cfg = cfg
        super().__init__(label="moe-lm", n_layers=cfg.n_layers, n_experts=cfg.n_experts, slots=slots,
                         scratch_row=cfg.scratch_row, tensors=lambda i: [expert_name(i, p) for p in EXPERT_PARTS],
                         source=source.__getitem__, trace=trace)
        self.source = source   # name -> [E, ...] experts (the mapped file's views, or host copies)
        if prefetch:
            if routers is None:
                raise ModelError("moe-lm: expert prefetch needs the router weights")
            self.set_routers(routers, prefetch)

    def set_routers(self, routers: Mapping[str, np.ndarray], prefetch: int | None = None) -> None:
        """Turn on prefetch (`prefetch` experts per token; default: the current setting) with these
        router weights `L{i}.router` [E, D], biases `L{i}.router_bias` [E] and FFN norm weights `L{i}.ffn_norm` [D]."""
        self.enable_prefetch(self.prefetch if prefetch is None else prefetch,
                             lambda i: (routers[f"L{i}.router"], routers[f"L{i}.router_bias"],
                                        routers[f"L{i}.ffn_norm"]))
