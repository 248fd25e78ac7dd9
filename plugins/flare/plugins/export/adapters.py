"""What the exporter needs from a model: config, serving range, programs per bucket, weights.

A model plugin's `ModelSpec` says how to *run* a model; exporting also needs
its shape buckets, whether it supports mixed batches, and a way to write its
weights. `ExportAdapter` is that contract; model plugins contribute adapters
through the `flare_export_adapters` hook (`flare.plugins.export.hookspecs`). Program buckets of the
`token-lm/1` contract are planned here so every LM exports the same way.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from flare.core.errors import InputError
from flare.core.graph import GraphBuilder

from .schema import Serving

EntryBuilder = Callable[[GraphBuilder, Mapping[str, tuple]], None]


@dataclass(frozen=True)
class ProgramSpec:
    """One program to capture: its kind, bucket, the entry builder and its input shapes."""

    kind: str
    tokens: int
    batch: int
    build: EntryBuilder
    shapes: Mapping[str, tuple]

    @property
    def name(self) -> str:
        return f"{self.kind}-t{self.tokens}-b{self.batch}"


class ExportAdapter(abc.ABC):
    """A model as the exporter sees it."""

    name: str = "?"

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """JSON-able model configuration (written to the manifest)."""

    @abc.abstractmethod
    def serving(self) -> Serving:
        """The serving range and batch contract of the exported programs."""

    @abc.abstractmethod
    def mixed_support(self) -> tuple[bool, str]:
        """(supported, why): whether a prefill chunk and decode tokens can share one step."""

    @abc.abstractmethod
    def programs(self, mixed: bool) -> list[ProgramSpec]:
        """Every program to export (mixed ones only when `mixed`)."""

    @abc.abstractmethod
    def write_weights(self, path: Path) -> None:
        """Write every weight the programs read to `path` as safetensors."""

    def draft_support(self) -> tuple[int, str]:
        """(default draft layers, why): layers of the model a self-draft keeps (0: no draft programs)."""
        return 0, f"{self.name} declares no draft model"

    def draft_programs(self, layers: int, max_draft: int) -> list[ProgramSpec]:
        """`draft` programs (the first `layers` layers and the head, sharing the model's KV state by
        name; one token per sequence) and `verify` programs (the full model, 1 + max_draft tokens of
        each sequence, logits of every token). Only called when `draft_support` is non-zero."""
        raise NotImplementedError(f"{self.name} has no draft programs")


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v < n:
        out.append(v)
        v *= 2
    return out + [n]


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def token_lm_buckets(serving: Serving, mixed: bool) -> list[tuple[str, int, int]]:
    """(kind, tokens, batch) of a token-lm/1 export.

    prefill: chunks of 1, 2, 4, ... up to max_prefill_tokens tokens, one sequence;
    decode: 1, 2, 4, ... up to max_seqs sequences, one token each;
    mixed: 2, 4, ... up to max_seqs sequences, one of them a prefill chunk: tokens = a full chunk
    plus one decode token of each other sequence (not rounded up: on the CPU every padded row
    costs as much as a real one).
    Smaller steps are padded into the next bucket (padding tokens use the scratch KV row).
    """
    out = [("prefill", t, 1) for t in _pow2_upto(serving.max_prefill_tokens)]
    out += [("decode", b, b) for b in _pow2_upto(serving.max_seqs)]
    if mixed and serving.max_seqs >= 2:
        out += [("mixed", serving.max_prefill_tokens + b - 1, b)
                for b in _pow2_upto(serving.max_seqs) if b >= 2]
    return out


def token_lm_draft_buckets(serving: Serving, max_draft: int) -> list[tuple[str, int, int]]:
    """(kind, tokens, batch) of speculative programs: draft like decode (1, 2, 4 ... max_seqs sequences,
    one token each); verify of 2, 4 ... max_seqs * (1 + max_draft) tokens of up to max_seqs sequences."""
    out = [("draft", b, b) for b in _pow2_upto(serving.max_seqs)]
    out += [("verify", t, min(t, serving.max_seqs))
            for t in _pow2_upto(serving.max_seqs * (1 + max_draft)) if t >= 2]
    return out


def token_lm_shapes(serving: Serving, kind: str, tokens: int, batch: int) -> dict[str, tuple]:
    """Input shapes of a token-lm/1 program (decode has no `out_rows`: logits of every token)."""
    shapes: dict[str, tuple] = {"tokens": (tokens,), "pos": (tokens,), "kv_rows": (tokens,),
                                "mask": (tokens, serving.kv_rows)}
    if kind not in ("decode", "draft", "verify"):
        shapes["out_rows"] = (batch,)
    return shapes


@dataclass(frozen=True)
class AdapterSpec:
    """What `flare_export_adapters` returns: `factory(**options)` builds the adapter of
    model `name` with its export options (size, seed, ...). `tokenizer(core_dir, manifest)`, if
    given, returns the model's `flare.plugins.export.serving.tokenizer.Tokenizer` (text and chat
    template) for `flare serve`; without it a core is served with the token-lm/1 byte tokenizer."""

    name: str
    factory: Callable[..., ExportAdapter]
    tokenizer: Callable[[Path, Any], Any] | None = None


def get_adapter(name: str, options: Mapping[str, Any] | None = None) -> ExportAdapter:
    """The adapter of a model, built with its export options (e.g. size, seed)."""
    from flare.core.plugin_manager import get_plugin_manager

    adapters = get_plugin_manager().collect("flare_export_adapters", AdapterSpec)
    if name not in adapters:
        raise InputError(f"model {name!r} cannot be exported; exportable: {', '.join(sorted(adapters)) or 'none'}")
    return adapters[name].factory(**dict(options or {}))
