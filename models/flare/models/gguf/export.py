"""Export adapter of GGUF models: programs per bucket and the file's weights, still quantized.

The core's programs are the same step graph `GgufLM` runs (built from the
file's shapes and dtypes; no tensor is read while capturing). The weights
file is safetensors, which has no block dtypes, so each quantized tensor is
written as its raw bytes (U8 [..., blocks * block bytes]) and the file's
`__metadata__` names its Flare dtype (`flare.plugins.export.files.BLOCK_DTYPES_KEY`);
the core's loader refuses a tensor whose bytes and declared dtype disagree.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flare.core.errors import ModelError

from flare.plugins.export.adapters import (ExportAdapter, ProgramSpec, token_lm_buckets, token_lm_draft_buckets,
                                          token_lm_shapes)
from flare.plugins.export.schema import Serving

KNOWN = ("target", "path", "max_ctx", "max_seqs", "prefill_chunk")


class GgufAdapter(ExportAdapter):
    name = "gguf"

    def __init__(self, target: str | None = None, path: str | None = None, max_ctx: int | None = None, max_seqs: int = 2,
                 prefill_chunk: int = 32, **unknown: Any):
        from .weights import GGUFModel

        if unknown:
            raise ModelError(f"gguf export: unknown options {sorted(unknown)} (known: {', '.join(KNOWN)})")
        target = target or path
        if target is None:
            raise ModelError("gguf export: give the file with --option path=FILE.gguf")
        from .weights import NAMED

        # a file by its absolute path: `flare serve NAME.core` reads the tokenizer from it, from any directory
        self.target = str(target) if str(target) in NAMED else str(Path(target).resolve())
        if max_ctx is None:     # 512 positions, or the file's whole context when it is shorter
            max_ctx = min(512, GGUFModel.open(self.target, max_ctx=2, prefill_chunk=1).cfg.context_length)
        self.model = GGUFModel.open(self.target, max_seqs=int(max_seqs), max_ctx=int(max_ctx),
                                    prefill_chunk=int(prefill_chunk))
        self.cfg = self.model.cfg
        if self.target == "smollm2":
            self.name = "smollm2"

    def config(self) -> dict[str, Any]:
        return {"target": self.target, "experts": "resident", **dataclasses.asdict(self.cfg)}

    def serving(self) -> Serving:
        from .model import serving_contract

        return serving_contract(self.cfg)

    def mixed_support(self) -> tuple[bool, str]:
        if self.cfg.max_seqs < 2:
            return False, f"{self.cfg.name} is exported for one sequence at a time (max_seqs 1)"
        return True, "the step graph takes a prefill chunk and decode tokens of other sequences in one batch"

    def _builders(self, n_layers: int | None = None):
        from .graph import GraphSpec, build_step

        spec = GraphSpec(self.cfg, self.model.infos())     # weights declared, never read here

        def prefill(b, shapes):
            build_step(b, spec, shapes, n_layers)

        def decode(b, shapes):
            build_step(b, spec, {k: v for k, v in shapes.items() if k != "out_rows"}, n_layers)
        return {"prefill": prefill, "mixed": prefill, "decode": decode}

    def programs(self, mixed: bool) -> list[ProgramSpec]:
        builders = self._builders()
        serving = self.serving()
        return [ProgramSpec(kind, t, b, builders[kind], token_lm_shapes(serving, kind, t, b))
                for kind, t, b in token_lm_buckets(serving, mixed)]

    def draft_support(self) -> tuple[int, str]:
        layers = max(1, self.cfg.n_layers // 3)
        return layers, (f"self-draft: the first {layers} of {self.cfg.n_layers} layers and the model's head, "
                        "sharing its weights and KV cache")

    def draft_programs(self, layers: int, max_draft: int) -> list[ProgramSpec]:
        if not 1 <= layers <= self.cfg.n_layers:
            raise ModelError(f"{self.cfg.name}: a draft keeps 1..{self.cfg.n_layers} layers, not {layers}")
        full, draft = self._builders()["decode"], self._builders(layers)["decode"]
        serving = self.serving()
        return [ProgramSpec(kind, t, b, draft if kind == "draft" else full, token_lm_shapes(serving, kind, t, b))
                for kind, t, b in token_lm_draft_buckets(serving, max_draft)]

    def write_weights(self, path: Path) -> None:
        """Every weight the programs read, quantized ones as U8 bytes with their dtype in the metadata."""
        import numpy as np
        from safetensors.numpy import save_file

        from flare.plugins.export.files import block_dtypes_metadata

        tensors, blocks = {}, {}
        for name, info in self.model.infos().items():
            array = self.model.tensor(name)
            if array.dtype.names:                          # a block dtype: its raw bytes
                blocks[name] = info.dtype
                array = array.view(np.uint8).reshape(*info.shape[:-1], -1)
            tensors[name] = np.ascontiguousarray(array)
        save_file(tensors, str(path), metadata=block_dtypes_metadata(blocks))
