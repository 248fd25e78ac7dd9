"""Expert staging straight from the GGUF file: no conversion step.

In `offload` mode each MoE layer owns three `cache` tensors (gate, up, down)
of S expert slots, in the file's own quantized dtype, named like the file's
`blk.{i}.ffn_{part}_exps.weight`. The graph's staging host node calls the
shared `flare.core.expert_staging.ExpertStager`, here reading the memory-mapped
`ffn_*_exps` tensors (rows of blocks, exactly as stored): it copies the
selected experts that are not resident into free or evictable slots and
returns each (token, choice)'s slot, so `mul_mat_id` indexes the cache instead
of all experts. Rules, eviction, prefetch and threads: see that module.
This module adds the file's names, its router (`ffn_gate_inp`, no bias) and
nothing else.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from flare.core.expert_staging import ExpertStager

from .config import LMConfig
from .graph import EXPERT_PARTS, expert_tensor


class FileExpertStager(ExpertStager):
    """The `stage_experts` host callback of one prepared GGUF MoE model."""

    def __init__(self, cfg: LMConfig, tensor: Callable[[str], np.ndarray], slots: int, prefetch: int = 0):
        self.cfg = cfg
        super().__init__(label=cfg.name, n_layers=cfg.n_layers, n_experts=cfg.n_experts, slots=slots,
                         scratch_row=cfg.scratch_row, tensors=lambda i: [expert_tensor(i, p) for p in EXPERT_PARTS],
                         source=tensor, prefetch=prefetch,
                         router=lambda i: (tensor(f"blk.{i}.ffn_gate_inp.weight"), None,
                                           tensor(f"blk.{i}.ffn_norm.weight")))
