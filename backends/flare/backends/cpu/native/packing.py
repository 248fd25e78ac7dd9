"""Constant weights pre-packed once for the native kernels (kernels.c: `pgemm`, conv1d.h's paths).

A weight stored [N, K] (the `transpose_b` right operand of a linear layer) is
copied into panels of 16 output columns, each [K][16] contiguous, zero-padded to
a multiple of 16 columns: (ceil(N / 16) * 16) * K floats, so at most 15 columns
more than the weight itself. Every prepared plan of a model (one per input shape)
would otherwise hold its own copy; `PackCache` keeps one packed copy per weight
buffer on the device, counted by the splits that use it, and frees it with the
last of them.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

PANEL = 16  # columns per panel: PANEL in kernels.c


def packed_size(n: int, k: int) -> int:
    """Floats of the packed copy of a [N, K] weight."""
    return -(-n // PANEL) * PANEL * k


def pack_into(dst: np.ndarray, w: np.ndarray) -> None:
    """Write weight w [N, K] into dst (flat f32, `packed_size` floats) as [N/16, K, 16] panels."""
    n, k = w.shape
    panels = dst.reshape(-1, k, PANEL)
    full = n // PANEL
    panels[:full] = w[: full * PANEL].reshape(full, PANEL, k).transpose(0, 2, 1)
    if full < panels.shape[0]:
        panels[full] = 0.0
        panels[full, :, : n - full * PANEL] = w[full * PANEL:].T


class _Lease:
    """One split's hold on a packed weight; `release()` drops it (the buffer goes with the last)."""

    def __init__(self, cache: "PackCache", key: tuple):
        self._cache, self._key = cache, key

    def release(self) -> None:
        if self._cache is not None:
            self._cache._drop(self._key)
            self._cache = None


class PackCache:
    """Packed copies of constant weights, shared by every split of one device."""

    def __init__(self, alloc: Callable[[int, str], Any]):
        self._alloc = alloc
        self._entries: dict[tuple, list[Any]] = {}  # key -> [buffer, view, count]

    def get(self, w: np.ndarray, name: str, owned: list[Any],
            layout: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """The packed copy of w [N, K] (f32) in panels, or, given `layout`, the array it makes of w
        (a flat f32 copy in the cache: the Winograd path's transformed weight); appends the split's
        lease to `owned`."""
        key = (w.ctypes.data, w.shape, w.strides, layout)
        entry = self._entries.get(key)
        if entry is None:
            made = None if layout is None else layout(w)
            size = packed_size(*w.shape) if made is None else made.size
            buf = self._alloc(size * 4, f"cpu:prepacked:{name}")
            view = buf.handle[: size * 4].view(np.float32)
            if made is None:
                pack_into(view, w)
            else:
                view[:] = made.reshape(-1)
            entry = self._entries[key] = [buf, view, 0]
        entry[2] += 1
        owned.append(_Lease(self, key))
        return entry[1]

    def _drop(self, key: tuple) -> None:
        entry = self._entries[key]
        entry[2] -= 1
        if entry[2] == 0:
            del self._entries[key]
            entry[0].release()

    def nbytes(self) -> int:
        return sum(e[1].nbytes for e in self._entries.values())
