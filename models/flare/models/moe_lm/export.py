"""Export adapter of `moe-lm`: its programs per bucket (resident experts) and its weights file.

Uses only moe-lm's public pieces (config sizes, the step graph builder,
`input_shapes`, the weights generator), so the core is built from the same
graph `MoeLM.step` runs. Experts are exported resident: a core's weights
file holds every expert, and expert parallelism slices them per rank at
load time.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from flare.core.errors import ModelError

from flare.plugins.export.adapters import (ExportAdapter, ProgramSpec, token_lm_buckets, token_lm_draft_buckets,
                                          token_lm_shapes)
from flare.plugins.export.schema import Serving


class MoeLmAdapter(ExportAdapter):
    name = "moe-lm"

    def __init__(self, size: str = "tiny", seed: int = 0, prefill_chunk: int | None = None,
                 max_ctx: int | None = None, **unknown: Any):
        from flare.models.moe_lm.config import get_config

        if unknown:
            raise ModelError(f"moe-lm export: unknown options {sorted(unknown)} (known: size, seed, prefill_chunk, max_ctx)")
        cfg = get_config(size)
        if prefill_chunk is not None:
            cfg = cfg.replace(prefill_chunk=int(prefill_chunk))
        if max_ctx is not None:      # a longer context (the prefix-cache benchmark's 200-token prefixes)
            if int(max_ctx) < 2:
                raise ModelError(f"moe-lm export: max_ctx must be >= 2, got {max_ctx}")
            cfg = cfg.replace(max_ctx=int(max_ctx))
        self.cfg = cfg
        self.seed = int(seed)

    def config(self) -> dict[str, Any]:
        return {"size": self.cfg.name, "seed": self.seed, "experts": "resident", **dataclasses.asdict(self.cfg)}

    def serving(self) -> Serving:
        from flare.models.moe_lm.batch import serving_contract

        return serving_contract(self.cfg)

    def mixed_support(self) -> tuple[bool, str]:
        from flare.models.moe_lm.graph import ENTRIES

        if "mixed" not in ENTRIES:
            return False, "moe-lm declares no mixed entry"
        if self.cfg.max_seqs < 2:
            return False, f"moe-lm {self.cfg.name} serves one sequence at a time (max_seqs 1)"
        return True, "moe-lm's step graph takes a prefill chunk and decode tokens of other sequences in one batch"

    def programs(self, mixed: bool) -> list[ProgramSpec]:
        from flare.models.moe_lm.graph import RESIDENT, GraphSpec, entry_builders

        builders = entry_builders(GraphSpec(self.cfg, {}, RESIDENT, 0))  # weights are declared, never read here
        serving = self.serving()
        return [ProgramSpec(kind, t, b, builders[kind], token_lm_shapes(serving, kind, t, b))
                for kind, t, b in token_lm_buckets(serving, mixed)]

    def draft_support(self) -> tuple[int, str]:
        layers = max(1, self.cfg.n_layers // 2)
        return layers, (f"self-draft: the first {layers} of {self.cfg.n_layers} layers and the model's head, "
                        "sharing its weights and KV cache")

    def draft_programs(self, layers: int, max_draft: int) -> list[ProgramSpec]:
        from flare.models.moe_lm.graph import RESIDENT, GraphSpec, entry_builders

        if not 1 <= layers <= self.cfg.n_layers:
            raise ModelError(f"moe-lm {self.cfg.name}: a draft keeps 1..{self.cfg.n_layers} layers, not {layers}")
        full = entry_builders(GraphSpec(self.cfg, {}, RESIDENT, 0))["decode"]
        draft = entry_builders(GraphSpec(self.cfg.replace(n_layers=layers), {}, RESIDENT, 0))["decode"]
        serving = self.serving()
        return [ProgramSpec(kind, t, b, draft if kind == "draft" else full, token_lm_shapes(serving, kind, t, b))
                for kind, t, b in token_lm_draft_buckets(serving, max_draft)]

    def write_weights(self, path: Path) -> None:
        from flare.models.moe_lm import weights

        shutil.copyfile(weights.ensure(self.cfg, self.seed), path)

