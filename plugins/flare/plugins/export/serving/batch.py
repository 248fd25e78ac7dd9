"""Step inputs of the `token-lm/1` contract (moe-lm's batch layout), built from the manifest alone.

A step is a list of chunks: a prefill chunk of one sequence or the one decode
token of another. Each token writes KV row `seq * max_ctx + pos`; its mask row
admits exactly its own sequence's rows up to its position. Padding tokens
(to reach a program's fixed bucket) write the scratch row and attend only to
it, and padded `out_rows` repeat the last real row.

The mask may cover only a *window*: KV rows [0, window) (`kv_window`), the
smallest bucket holding every row the step's tokens can see, so attention costs
what the sequences use, not the cache's capacity (max_seqs x max_ctx). A graph
that reads the mask's width slices its keys and values to it; rows outside
contribute nothing either way (a masked row's weight is exactly 0). When the
scratch row lies outside the window, padding tokens attend to row 0 instead
(their outputs are never read). A core runs without its
model plugin, so the layout is defined here, by the contract; moe-lm builds its
own steps with it (`flare.models.moe_lm.batch.make_inputs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from flare.core.errors import InputError

if TYPE_CHECKING:
    from flare.plugins.export.schema import Serving

MASK_NEG = np.float32(-1e30)
# Smallest KV window. 128, not 64: at 64 rows a one-token step's attention products (1 x 64 x 64
# for a head of 64) fall under the CPU's small-GEMM threshold (lowering.SMALL_GEMM) and are summed
# in another order than at larger windows, so logits would move by float32 rounding with the window
# alone; from 128 up they match the step over every row bit for bit (measured on SmolLM2). Once the
# CPU's reductions do not depend on the key count, 64 saves a little more.
MIN_WINDOW = 128


def pow2_chunks(n: int, limit: int) -> list[int]:
    """A prompt of n tokens as power-of-two prefill chunks of at most `limit`, largest first:
    few distinct step shapes (a plan each), and no padded rows."""
    out = []
    while n > 0:
        size = 1 << (min(n, limit).bit_length() - 1)
        out.append(size)
        n -= size
    return out


def kv_window(serving: "Serving", chunks: Sequence, *, padded: bool = False, min_window: int = MIN_WINDOW) -> int:
    """KV rows a step's mask must cover: the smallest power of two >= `min_window` holding the
    highest row any chunk's tokens see (`seq * max_ctx + start + len`), capped at `kv_rows`.
    Powers of two keep the plans (one per tokens x window) few: log2(kv_rows / min_window) + 1.
    `padded` steps are no different: their padding attends to row 0 when the scratch row is out."""
    need = max((c.seq * serving.max_ctx + c.start + len(c.tokens) for c in chunks), default=1)
    window = max(min_window, 1 << (max(need, 1) - 1).bit_length())
    return min(window, serving.kv_rows)


@dataclass(frozen=True)
class Chunk:
    """`tokens` of sequence slot `seq`, the first at position `start`."""

    seq: int
    start: int
    tokens: tuple[int, ...]

    def to_list(self) -> list:
        return [self.seq, self.start, list(self.tokens)]

    @classmethod
    def from_list(cls, item: Sequence) -> "Chunk":
        seq, start, tokens = item
        return cls(int(seq), int(start), tuple(int(t) for t in tokens))


def token_lm_inputs(serving: "Serving", chunks: Sequence[Chunk], *, tokens: int,
                    batch: int | None, window: int | None = None) -> dict[str, np.ndarray]:
    """Inputs of one step padded to `tokens` rows; `batch` logit rows (None: decode, every row);
    a mask over KV rows [0, window) (None: every KV row, the shape exported programs take).

    `chunks`: `Chunk`s, or any objects with the same `seq`, `start` and `tokens` (a tuple of
    ints; moe-lm's SeqChunk). Called once per decode step, so the small vectors are built as
    Python lists and converted once (a NumPy fill or slice per row costs more than the list)."""
    if not chunks:
        raise InputError("a step needs at least one chunk")
    seqs = [c.seq for c in chunks]
    if len(set(seqs)) != len(seqs):
        raise InputError(f"a step holds a sequence twice: {seqs}")
    n = sum(len(c.tokens) for c in chunks)
    if n > tokens or (batch is not None and len(chunks) > batch):
        raise InputError(f"{n} tokens of {len(chunks)} sequences do not fit a bucket of {tokens} tokens, batch {batch}")
    max_ctx, scratch = serving.max_ctx, serving.scratch_row
    width = serving.kv_rows if window is None else int(window)
    toks: list[int] = []
    pos: list[int] = []
    rows: list[int] = []
    mask = np.empty((tokens, width), np.float32)
    mask.fill(MASK_NEG)                       # empty + fill: a fifth of np.full's cost at this size
    last = []
    for c in chunks:
        k = len(c.tokens)
        if not 0 <= c.seq < serving.max_seqs or k == 0 or c.start < 0 or c.start + k > max_ctx:
            raise InputError(f"chunk (seq {c.seq}, start {c.start}, {k} tokens) is outside max_seqs "
                             f"{serving.max_seqs} / max_ctx {max_ctx}")
        base = c.seq * max_ctx
        if not 0 < width <= serving.kv_rows or base + c.start + k > width:
            raise InputError(f"chunk (seq {c.seq}, start {c.start}, {k} tokens) sees KV rows up to "
                             f"{base + c.start + k - 1}, outside the window of {width} rows "
                             f"(kv_rows {serving.kv_rows})")
        at = len(toks)
        toks.extend(c.tokens)
        pos.extend(range(c.start, c.start + k))
        rows.extend(range(base + c.start, base + c.start + k))
        for i in range(k):
            mask[at + i, base: base + c.start + i + 1] = 0.0
        last.append(at + k - 1)
    pad = tokens - n
    if pad:
        toks.extend([serving.pad] * pad)
        pos.extend([0] * pad)
        rows.extend([scratch] * pad)
        mask[n:, scratch if scratch < width else 0] = 0.0
    vectors = np.array((toks, pos, rows), np.int32)    # one conversion; each input a contiguous row of it
    inputs = {"tokens": vectors[0], "pos": vectors[1], "kv_rows": vectors[2], "mask": mask}
    if batch is not None:
        inputs["out_rows"] = np.array(last + [last[-1]] * (batch - len(last)), np.int32)
    return inputs
