"""A toy token LM for tests: exports in milliseconds and has a kernel only its mixed programs use.

`ToyLM` follows the `token-lm/1` contract (tokens, pos, kv_rows, mask,
out_rows -> logits, one KV state shared by all programs) with one attention
layer. Its mixed programs add an exact no-op `scale` node, so a catalog has
a kernel (and, through the larger bucket, tuning entries) that only mixed
programs need: what pruning tests look for. `mixed=False` makes a model that
declares no mixed support.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from flare.core.graph import GraphBuilder

from .adapters import ExportAdapter, ProgramSpec, token_lm_buckets, token_lm_shapes
from .schema import Serving

VOCAB, PAD, EOS, BOS = 260, 258, 257, 256


class ToyLM(ExportAdapter):
    name = "toy-lm"

    def __init__(self, mixed: bool = True, d: int = 16, max_seqs: int = 4, max_ctx: int = 32,
                 max_prefill_tokens: int = 4, seed: int = 0):
        self.mixed = mixed
        self.d = d
        self._serving = Serving("token-lm/1", max_seqs, max_ctx, max_prefill_tokens, VOCAB, PAD, EOS, (BOS, PAD))
        rng = np.random.default_rng(seed)
        self.tensors = {"emb": rng.standard_normal((VOCAB, d), dtype=np.float32),
                        "out": (rng.standard_normal((VOCAB, d), dtype=np.float32) / np.float32(4))}

    def config(self) -> dict[str, Any]:
        return {"d": self.d, "mixed": self.mixed}

    def serving(self) -> Serving:
        return self._serving

    def mixed_support(self) -> tuple[bool, str]:
        return (True, "toy-lm batches chunks of several sequences") if self.mixed else \
            (False, "toy-lm was built with mixed=False")

    def _build(self, kind: str):
        sv, tensors = self._serving, self.tensors

        def build(b: GraphBuilder, shapes: Mapping[str, tuple]) -> None:
            t = shapes["tokens"][0]
            tokens = b.input("tokens", (t,), "i32")
            b.input("pos", (t,), "i32")
            rows = b.input("kv_rows", (t,), "i32")
            mask = b.input("mask", (t, sv.kv_rows))
            emb = b.get_rows(b.weight("emb", tensors["emb"]), tokens, name="embed")
            kv = b.set_rows(b.state("kv", (sv.kv_rows, self.d)), rows, emb, name="kv_store")
            probs = b.softmax(b.matmul(emb, kv, transpose_b=True, name="scores"), mask, name="probs")
            h = b.add(emb, b.matmul(probs, kv, name="ctx"), name="residual")
            if kind == "mixed":
                h = b.scale(h, scale=1.0, name="mixed_only")   # exact no-op: a kernel only mixed programs use
            if "out_rows" in shapes:
                h = b.get_rows(h, b.input("out_rows", shapes["out_rows"], "i32"), name="select_rows")
            b.output("logits", b.matmul(h, b.weight("out", tensors["out"]), transpose_b=True, name="logits"))
        return build

    def programs(self, mixed: bool) -> list[ProgramSpec]:
        return [ProgramSpec(kind, t, b, self._build(kind), token_lm_shapes(self._serving, kind, t, b))
                for kind, t, b in token_lm_buckets(self._serving, mixed)]

    def write_weights(self, path: Path) -> None:
        from safetensors.numpy import save_file

        save_file(self.tensors, str(path))
