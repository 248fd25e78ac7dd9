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


class CommandList:
    """One `flare_cmd[]` built from command dicts; keeps every array it points into alive."""

    def __init__(self, native: Native, cmds: Sequence[Cmd], names: Sequence[str], scratch: np.ndarray | None,
                 pool: ThreadPool | None = None):
        ffi = native.ffi
        self._lib, self._n, self._names = native.lib, len(cmds), list(names)
        self._pool = pool
        self._arr = ffi.new("flare_cmd[]", max(len(cmds), 1))
        self._err = ffi.new("int32_t *")
        self._keep: list[Any] = [scratch]
        for rec, c in zip(self._arr, cmds):
            rec.kind, rec.flags = c["kind"], int(c["flags"])
            rec.out = ffi.cast("void *", c["out"].ctypes.data)
            for i, s in enumerate(c["src"]):
                rec.src[i] = ffi.cast("void *", 0 if s is None else s.ctypes.data)
            for i in range(4):
                rec.ne[i], rec.os[i] = int(c["ne"][i]), int(c["os"][i])
            for i, st in enumerate(c["ss"]):
                for j in range(4):
                    rec.ss[i][j] = int(st[j])
            for i, v in enumerate(c["ip"]):
                rec.ip[i] = int(v)
            for i, v in enumerate(c["fp"]):
                rec.fp[i] = float(v)
            if c["scratch"]:
                rec.scratch = ffi.cast("void *", scratch.ctypes.data)
            self._keep.extend([c["out"], *c["src"]])

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
