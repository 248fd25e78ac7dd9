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


def _source_rows(sources: Sequence[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The tables staging.c reads of the sources, shared by the step and the command: the
    sources as C-contiguous uint8 [E, bytes] (checked), their row bytes and their addresses
    (the caller keeps the arrays alive)."""
    srcs = [np.ascontiguousarray(s) for s in sources]
    for src in srcs:
        if src.dtype != np.uint8 or src.ndim != 2:
            raise ValueError(f"expert source bytes must be uint8 [E, bytes], not {src.dtype} {src.shape}")
    return srcs, np.array([s.shape[1] for s in srcs], np.int64), np.array([s.ctypes.data for s in srcs], np.uint64)


def _check_cache_rows(dst: np.ndarray, row_bytes: int) -> None:
    """A cache's host rows the C step may write: writable C-contiguous uint8 [S, row_bytes]."""
    if dst.dtype != np.uint8 or dst.ndim != 2 or dst.shape[1] != row_bytes or not dst.flags.c_contiguous \
            or not dst.flags.writeable:
        raise ValueError(f"expert cache rows {dst.dtype} {dst.shape} do not take source rows of {row_bytes} bytes")


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
        self._sources, self._row_bytes, self._src_ptrs = _source_rows(sources)
        self._targets = list(targets)
        self._dsts: list[np.ndarray | None] = [None] * len(self._targets)
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
        _check_cache_rows(dst, int(self._row_bytes[i]))
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


class WalkBlock:
    """One layer's staging step as a command of a split (`stage_experts` in kernels.c), so the
    walk never leaves C: `array` (int64 [16]) is what the command reads, pointers to the stager's
    arrays of the layer (rebound with `bind` whenever the stager replaces them: a new layer's
    records after `invalidate`), the cache rows (taken when the split is compiled: the caches
    are persistent tensors, a move rebinds the plan and so compiles this again), the source rows,
    their row bytes, and `acc`, the stager's counters the command adds to (int64 [8]: calls,
    needed, missing, evicted, runs, copy ns, step ns, calls with a copy). Calling it with the walk's
    error code gives the stager's exception (`on_error(code - ERR_STAGE)`).

    Threads: the command runs on one of the device's threads inside an execute (the walk takes
    no other command meanwhile); the stager rebinds between executes."""

    ERR_STAGE = 16

    def __init__(self, sources: Sequence[np.ndarray], dsts: Sequence[np.ndarray], acc: np.ndarray,
                 age_every: int, on_error: Callable[[int], BaseException]):
        self._sources, self._row_bytes, self._src_ptrs = _source_rows(sources)
        self._dsts = list(dsts)
        for dst, row_bytes in zip(self._dsts, self._row_bytes.tolist()):
            _check_cache_rows(dst, row_bytes)
        if acc.dtype != np.int64 or acc.shape != (8,) or not acc.flags.c_contiguous:
            raise ValueError("staging counters must be int64 [8]")
        self._acc = acc
        self._dst_ptrs = np.array([d.ctypes.data for d in self._dsts], np.uint64)
        self.array = np.zeros(16, np.int64)
        a = self.array
        a[8], a[9], a[10], a[11] = (self._dst_ptrs.ctypes.data, self._src_ptrs.ctypes.data,
                                    self._row_bytes.ctypes.data, acc.ctypes.data)
        a[14], a[15] = int(age_every), len(self._sources)
        self._state: Any = None
        self._on_error = on_error

    def bind(self, state: Any) -> None:
        """Point the command at `state`'s arrays (StageStep's layout: table, expert_in, uses,
        last, counters, mark, record, info)."""
        self._state = state              # kept alive: the block points into it
        a = self.array
        for i, arr in enumerate((state.table, state.expert_in, state.uses, state.last, state.counters,
                                 state.mark, state.record, state.info)):
            a[i] = arr.ctypes.data
        a[12], a[13] = int(state.table.shape[0]), int(state.expert_in.shape[0])

    def __call__(self, code: int) -> BaseException:
        return self._on_error(code - self.ERR_STAGE)


def stage_command(block: WalkBlock, ids: np.ndarray, rows: np.ndarray | None, out: np.ndarray,
                  scratch_row: int) -> dict | None:
    """The `stage_experts` command over the split's views (ids int32 [T, k], rows int32 [T] or
    None, out int32 of ids' shape, all C-contiguous), or None where they are laid out otherwise."""
    from ..lowering import cmd
    if ids.dtype != np.int32 or out.dtype != np.int32 or ids.shape != out.shape or not ids.flags.c_contiguous \
            or not out.flags.c_contiguous:
        return None
    n_tok = ids.shape[0] if ids.ndim else 1
    if rows is not None and (rows.dtype != np.int32 or rows.shape != (n_tok,) or not rows.flags.c_contiguous):
        return None
    c = cmd("stage_experts", out, [ids, rows, block.array], (1, 1, 1, ids.size), (0, 0, 0, 1), [],
            ip=(n_tok, ids.size // n_tok if n_tok else 0, int(scratch_row)))
    c["error"] = block
    return c
