"""Compiled CPU splits: what `CpuDevice.compile_split` returns and `PreparedSplit.run` runs.

`CpuSplit` is a list of NumPy closures (the executor where the C kernels do not
build, or `native = false`). `NativeSplit` is the native executor's: consecutive
natively-covered nodes form one `flare_cmd[]` (`CommandList`) run by a single
`flare_run` call; a node the native path does not cover runs its NumPy kernel in
between. A split whose nodes are all covered is one call into C.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from flare.core.backend import PreparedSplit

from .lowering import Cmd
from .native import Native
from .native.threads import ThreadPool


class CpuSplit(PreparedSplit):
    """A split as a list of closures with their arena views already bound.

    It may own buffers of its own (weights repacked for a tuned kernel variant),
    allocated through the ledger and released with the split."""

    def __init__(self, steps: list[Callable[[], None]], owned: list[Any] | None = None):
        self._steps = steps
        self._owned = owned or []

    def run(self) -> None:
        for step in self._steps:
            step()

    def describe(self) -> dict[str, Any]:
        return {"executor": "numpy", "numpy_nodes": len(self._steps)}

    def release(self) -> None:
        self._steps = []
        for buf in self._owned:
            buf.release()
        self._owned = []



_ERRORS = {1: IndexError, 2: RuntimeError, 3: RuntimeError}
_MESSAGES = {1: "index out of range", 2: "unknown kernel id", 3: "no BLAS installed"}


_RECORD_DTYPES: dict[int, np.dtype] = {}  # id(ffi) -> the NumPy twin of `flare_cmd`


def record_dtype(ffi: Any) -> np.dtype:
    """A structured dtype laid out as cffi lays out `flare_cmd` (offsets and size asked of cffi,
    so the two cannot drift apart): the records are built as one NumPy array from tuples instead
    of field by field through cffi, which was most of `CommandList.__init__`'s cost."""
    dt = _RECORD_DTYPES.get(id(ffi))
    if dt is None:
        fields = (("kind", "<i4"), ("flags", "<i4"), ("out", "<u8"), ("src", ("<u8", (4,))), ("ne", ("<i8", (4,))),
                  ("os", ("<i8", (4,))), ("ss", ("<i8", (4, 4))), ("ip", ("<i8", (8,))), ("fp", ("<f8", (4,))),
                  ("scratch", "<u8"))
        dt = np.dtype({"names": [n for n, _ in fields], "formats": [f for _, f in fields],
                       "offsets": [ffi.offsetof("flare_cmd", n) for n, _ in fields],
                       "itemsize": ffi.sizeof("flare_cmd")})
        _RECORD_DTYPES[id(ffi)] = dt
    return dt


_NO_ROW = (0, 0, 0, 0)


def _record(c: Cmd, scratch_ptr: int, ptrs: dict[int, int]) -> tuple:
    """One command dict as a `flare_cmd` tuple (pointers as integers, short lists zero-padded).
    `ptrs`: id(array) -> its data pointer, for the arrays of one list (kept alive meanwhile): the
    same arena views recur from command to command, and `.ctypes.data` builds an object per call."""
    src = [0 if a is None else _ptr(a, ptrs) for a in c["src"]]
    ss = [list(st) for st in c["ss"]]
    ip, fp = list(c["ip"]), list(c["fp"])
    return (c["kind"], int(c["flags"]), _ptr(c["out"], ptrs), src + [0] * (4 - len(src)), c["ne"], c["os"],
            ss + [_NO_ROW] * (4 - len(ss)), ip + [0] * (8 - len(ip)), fp + [0.0] * (4 - len(fp)),
            scratch_ptr if c["scratch"] else 0)


def _ptr(a: np.ndarray, ptrs: dict[int, int]) -> int:
    p = ptrs.get(id(a))
    if p is None:
        p = ptrs[id(a)] = a.ctypes.data
    return p


class CommandList:
    """One `flare_cmd[]` built from command dicts; keeps every array it points into alive.

    The records live in a NumPy array of `record_dtype` (cffi sees them through a cast pointer):
    read-only to the C side, alive as long as this object."""

    def __init__(self, native: Native, cmds: Sequence[Cmd], names: Sequence[str], scratch: np.ndarray | None,
                 pool: ThreadPool | None = None):
        ffi = native.ffi
        self._lib, self._n, self._names = native.lib, len(cmds), list(names)
        self._pool = pool
        scratch_ptr = scratch.ctypes.data if scratch is not None else 0
        self._records = np.zeros(max(len(cmds), 1), record_dtype(ffi))
        if cmds:
            ptrs: dict[int, int] = {}
            self._records[:] = [_record(c, scratch_ptr, ptrs) for c in cmds]
        self._arr = ffi.cast("flare_cmd *", ffi.from_buffer(self._records))
        self._err = ffi.new("int32_t *")
        self._keep: list[Any] = [scratch]
        # command index -> its error (a staging command's ExpertCacheError, named by the stager)
        self._errors = {i: c["error"] for i, c in enumerate(cmds) if c.get("error") is not None}
        for c in cmds:
            self._keep.append(c["out"])
            self._keep.extend(c["src"])

    def split_commands(self) -> int:
        """Commands that run split across the pool's threads (0 with one thread)."""
        nth = self._pool.threads if self._pool is not None else 1
        return int(self._lib.flare_split_count(self._arr, self._n, nth))

    def __call__(self) -> None:
        # on the device's threads (flare_run_pool runs it on this thread when the pool is busy)
        pool = self._pool
        failed = (self._lib.flare_run_pool(pool.ptr, self._arr, self._n, self._err) if pool is not None
                  else self._lib.flare_run(self._arr, self._n, self._err))
        if failed:
            code = self._err[0]
            error = self._errors.get(failed - 1)
            if error is not None:
                raise error(code)
            raise _ERRORS.get(code, RuntimeError)(
                f"native CPU kernel of node {self._names[failed - 1]!r}: {_MESSAGES.get(code, f'error {code}')}")


class NativeSplit(PreparedSplit):
    """`steps` run in order: CommandLists and NumPy closures. Owns ledger buffers (scratch, packs)."""

    def __init__(self, steps: list[Callable[[], None]], owned: list[Any], info: dict[str, Any]):
        self._steps = steps
        self._owned = owned
        self.info = info
        if len(steps) == 1:
            self.run = steps[0]  # type: ignore[method-assign]  # one call into C, no loop

    def run(self) -> None:
        for step in self._steps:
            step()

    def release(self) -> None:
        self._steps = []
        self.run = lambda: None  # type: ignore[method-assign]
        for buf in self._owned:
            buf.release()
        self._owned = []

    def describe(self) -> dict[str, Any]:
        return dict(self.info)
