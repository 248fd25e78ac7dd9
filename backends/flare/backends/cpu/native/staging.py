"""The C expert-staging step (staging.c) bound to one layer's arrays: what the CPU device offers
`flare.core.expert_staging.ExpertStager` as `expert_stage_step` (host-memory caches only).

Why a binding object: a staging call runs on every MoE layer of every step, so the cffi
pointers to the arrays that do not change between calls (the stager's slot table, counts,
ticks; the sources; the cache rows) are cast once here, and a call passes only the step's ids,
valid rows and output. The cache rows are looked up on every call (`targets`, cheap) and the
pointer table is rebuilt only when a cache's host view changed.

Threads: a binding belongs to one layer of one stager; the stager calls it from the executes of
its prepared graph, which take turns. It shares nothing else.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from . import Native

# staging.c's return codes
OK, TOO_MANY, BAD_ID, NO_VICTIM = 0, 1, 2, 3


class StageStep:
    """`flare_stage_experts` for one layer. `state` holds the stager's arrays of the layer: table
    (int32 [E]), expert_in (int32 [S], -1 empty), uses, last (float64 [E]), counters (int64 [2]:
    calls, empty slots), mark (uint8 [E], zeros), record (int32 [6 S]), info (int64 [5]); sources:
    uint8 [E, bytes] per tensor; targets: per tensor, a function giving the cache rows (uint8
    [S, bytes], the same row bytes)."""

    def __init__(self, native: Native, state: Any, sources: Sequence[np.ndarray],
                 targets: Sequence[Callable[[], np.ndarray]], age_every: int):
        ffi = self._ffi = native.ffi
        self._fn = native.lib.flare_stage_experts
        self._state = state                     # kept alive: the pointers below point into it
        self._sources = [np.ascontiguousarray(s) for s in sources]
        self._targets = list(targets)
        self._dsts: list[np.ndarray | None] = [None] * len(self._targets)
        for src in self._sources:
            if src.dtype != np.uint8 or src.ndim != 2:
                raise ValueError(f"expert source bytes must be uint8 [E, bytes], not {src.dtype} {src.shape}")
        self._row_bytes = np.array([s.shape[1] for s in self._sources], np.int64)
        self._src_ptrs = np.array([s.ctypes.data for s in self._sources], np.uint64)
        self._dst_ptrs = np.zeros(len(self._sources), np.uint64)
        p = ffi.from_buffer
        self._args = (p("int32_t[]", state.table), p("int32_t[]", state.expert_in), p("double[]", state.uses),
                      p("double[]", state.last), p("int64_t[]", state.counters), int(state.table.shape[0]),
                      int(state.expert_in.shape[0]), int(age_every), len(self._sources),
                      ffi.cast("uint8_t **", p(self._dst_ptrs)), ffi.cast("uint8_t **", p(self._src_ptrs)),
                      p("int64_t[]", self._row_bytes), p("uint8_t[]", state.mark), p("int32_t[]", state.record),
                      p("int64_t[]", state.info))
        self._null = ffi.NULL

    def _retarget(self, i: int, dst: np.ndarray) -> None:
        """Point tensor i's cache pointer at `dst`, its cache's current host view."""
        if dst.shape[1] != self._row_bytes[i] or not dst.flags.c_contiguous or not dst.flags.writeable:
            raise ValueError(f"expert cache rows {dst.shape} do not take source rows of {self._row_bytes[i]} bytes")
        self._dsts[i] = dst
        self._dst_ptrs[i] = dst.ctypes.data

    def __call__(self, ids: np.ndarray, valid: np.ndarray | None, out: np.ndarray) -> int:
        """Stage one step: ids int32 [T, k] (C order), valid uint8/bool [T] or None, out int32 of
        ids' shape (written). Returns staging.c's code; the state's `info`/`record` say what it did."""
        dsts = self._dsts
        for i, target in enumerate(self._targets):    # the caches' current views (InputError once released)
            dst = target()
            if dst is not dsts[i]:
                self._retarget(i, dst)
        p = self._ffi.from_buffer
        n_tok = ids.shape[0] if ids.ndim else 1
        return self._fn(p("int32_t[]", ids), n_tok, ids.size // n_tok if n_tok else 0,
                        self._null if valid is None else p("uint8_t[]", valid), p("int32_t[]", out), *self._args)
