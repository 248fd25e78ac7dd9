"""Batches: several sequences' tokens in one step, each with its own position.

A step is a list of `SeqChunk`s (a prefill chunk of one sequence, or the one
decode token of another). Their tokens are flattened; each token's KV row is
`seq * max_ctx + pos`, and its mask row admits exactly the rows of its own
sequence up to its own position. Writes happen before attention in the graph,
so a chunk attends causally to itself. Padding tokens (to reach a captured
shape) write the scratch row and attend only to it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from flare.errors import ModelError

from .config import PAD, MoeConfig

MASK_NEG = np.float32(-1e30)  # finite: exp() of it minus the row max is exactly 0 on every backend


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
    """Graph inputs for one step. `out_rows`: select each chunk's last token's logits."""
    if not chunks:
        raise ModelError("moe-lm: a step needs at least one sequence chunk")
    seqs = [c.seq for c in chunks]
    if len(set(seqs)) != len(seqs):
        raise ModelError(f"moe-lm: a step holds sequence(s) {sorted(s for s in set(seqs) if seqs.count(s) > 1)} twice")
    toks, pos, seq_of = [], [], []
    last = []
    for c in chunks:
        if not 0 <= c.seq < cfg.max_seqs:
            raise ModelError(f"moe-lm: sequence slot {c.seq} outside 0..{cfg.max_seqs - 1}")
        if not c.tokens:
            raise ModelError(f"moe-lm: empty chunk for sequence {c.seq}")
        if c.start < 0 or c.start + len(c.tokens) > cfg.max_ctx:
            raise ModelError(f"moe-lm: sequence {c.seq} positions {c.start}..{c.start + len(c.tokens) - 1} exceed "
                             f"the context of {cfg.max_ctx} tokens")
        bad = [t for t in c.tokens if not 0 <= t < cfg.vocab]
        if bad:
            raise ModelError(f"moe-lm: token ids {bad[:4]} outside the vocabulary 0..{cfg.vocab - 1}")
        toks.extend(c.tokens)
        pos.extend(range(c.start, c.start + len(c.tokens)))
        seq_of.extend([c.seq] * len(c.tokens))
        last.append(len(toks) - 1)
    n = len(toks)
    total = n if pad_to is None else pad_to
    if total < n:
        raise ModelError(f"moe-lm: {n} tokens do not fit a padded step of {total}")
    tokens = np.full(total, PAD, np.int32)
    positions = np.zeros(total, np.int32)
    rows = np.full(total, cfg.scratch_row, np.int32)
    tokens[:n] = toks
    positions[:n] = pos
    seq_arr = np.asarray(seq_of, np.int64)
    rows[:n] = seq_arr * cfg.max_ctx + positions[:n]
    mask = np.full((total, cfg.kv_rows), MASK_NEG, np.float32)
    cols = np.arange(cfg.kv_rows)[None, :]
    first = (seq_arr * cfg.max_ctx)[:, None]
    mask[:n][(cols >= first) & (cols <= first + positions[:n, None])] = 0.0
    mask[n:, cfg.scratch_row] = 0.0
    inputs = {"tokens": tokens, "pos": positions, "kv_rows": rows, "mask": mask}
    if out_rows:
        inputs["out_rows"] = np.asarray(last, np.int32)
    return inputs


def pow2_chunks(n: int, limit: int) -> list[int]:
    """Split n tokens into power-of-two chunks of at most `limit` (few distinct shapes, no padding)."""
    out = []
    while n > 0:
        size = 1 << (min(n, limit).bit_length() - 1)
        out.append(size)
        n -= size
    return out
