"""Batches: several sequences' tokens in one step, each with its own position.

A step is a list of `SeqChunk`s (a prefill chunk of one sequence, or the one
decode token of another). Their tokens are flattened; each token's KV row is
`seq * max_ctx + pos`, and its mask row admits exactly the rows of its own
sequence up to its own position. Writes happen before attention in the graph,
so a chunk attends causally to itself. Padding tokens (to reach a captured
shape) write the scratch row and attend only to it.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from flare.core.errors import ModelError

from .config import EOS, PAD, MoeConfig

if TYPE_CHECKING:
    from flare.plugins.export.schema import Serving



@dataclass(frozen=True)
class SeqChunk:
    """`tokens` of sequence slot `seq`, the first at position `start`."""

    seq: int
    start: int
    tokens: tuple[int, ...]

    def __init__(self, seq: int, start: int, tokens: Sequence[int]):
        object.__setattr__(self, "seq", int(seq))
        object.__setattr__(self, "start", int(start))
        object.__setattr__(self, "tokens", tuple(int(t) for t in tokens))


def make_inputs(cfg: MoeConfig, chunks: Sequence[SeqChunk], *, pad_to: int | None = None,
                out_rows: bool = True) -> dict[str, np.ndarray]:
    """Graph inputs for one step. `out_rows`: select each chunk's last token's logits.

    The layout is the `token-lm/1` contract an exported core is served with
    (`flare.plugins.export.serving.batch.token_lm_inputs`); moe-lm implements it,
    so it builds its steps with the contract's own function after checking what
    only the model knows (vocabulary, its own limits, with moe-lm's messages)."""
    from flare.plugins.export.serving.batch import token_lm_inputs

    if not chunks:
        raise ModelError("moe-lm: a step needs at least one sequence chunk")
    seqs = [c.seq for c in chunks]
    if len(set(seqs)) != len(seqs):
        raise ModelError(f"moe-lm: a step holds sequence(s) {sorted(s for s in set(seqs) if seqs.count(s) > 1)} twice")
    for c in chunks:
        if not 0 <= c.seq < cfg.max_seqs:
            raise ModelError(f"moe-lm: sequence slot {c.seq} outside 0..{cfg.max_seqs - 1}")
        if not c.tokens:
            raise ModelError(f"moe-lm: empty chunk for sequence {c.seq}")
        if c.start < 0 or c.start + len(c.tokens) > cfg.max_ctx:
            raise ModelError(f"moe-lm: sequence {c.seq} positions {c.start}..{c.start + len(c.tokens) - 1} exceed "
                             f"the context of {cfg.max_ctx} tokens")
        if min(c.tokens) < 0 or max(c.tokens) >= cfg.vocab:
            bad = [t for t in c.tokens if not 0 <= t < cfg.vocab]
            raise ModelError(f"moe-lm: token ids {bad[:4]} outside the vocabulary 0..{cfg.vocab - 1}")
    n = sum(len(c.tokens) for c in chunks)
    total = n if pad_to is None else pad_to
    if total < n:
        raise ModelError(f"moe-lm: {n} tokens do not fit a padded step of {total}")
    # SeqChunk has Chunk's fields (seq, start, a tuple of int tokens): passed as they are
    return token_lm_inputs(serving_contract(cfg), chunks, tokens=total, batch=len(chunks) if out_rows else None)


@functools.lru_cache(maxsize=16)
def serving_contract(cfg: MoeConfig) -> "Serving":
    """moe-lm's sizes as the `token-lm/1` serving contract (what an exported core's manifest says).
    Cached per config (frozen, so hashable): every step asks for it, and building it costs ~10 us."""
    from flare.plugins.export.schema import Serving

    from .sampling import NEVER

    return Serving("token-lm/1", cfg.max_seqs, cfg.max_ctx, cfg.prefill_chunk, cfg.vocab, PAD, EOS, tuple(NEVER))
