"""Reading and writing state and cache tensors from the host: whole, or rows of them.

KV-cache reuse (a served prefix copied into a new sequence's rows), host callbacks
(expert staging writes the cache) and tests use them through PreparedGraph's
`state`, `read_rows` and `write_rows`, which take the graph's guard first.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .backend import Binding, Device
from .dtypes import to_numpy
from .errors import InputError
from .persistent import PersistentStore


def whole(store: PersistentStore, name: str) -> tuple[str, Binding]:
    """(device, binding) of the state/cache tensor `name`."""
    dev, buf, t = store.states[name]
    return dev, Binding(buf, 0, t.shape, t.strides, t.dtype)


def rows(store: PersistentStore, name: str, row: int, count: int) -> tuple[str, Binding]:
    """(device, binding) of rows [row, row+count) of `name`; InputError outside it."""
    dev, buf, t = store.states[name]
    row_elems = math.prod(t.shape[1:])   # math.prod: a tuple of ints, no NumPy reduction per call
    if count < 0 or row < 0 or row + count > t.shape[0]:
        raise InputError(f"rows [{row}, {row + count}) are outside {name!r} {t.shape}")
    itemsize = to_numpy(t.dtype).itemsize
    return dev, Binding(buf, row * row_elems * itemsize, (count, *t.shape[1:]),
                        (row_elems, *t.strides[1:]) if len(t.shape) > 1 else (1,), t.dtype)


def _host_rows(store: PersistentStore, devices: Mapping[str, Device], name: str) -> tuple[np.ndarray, int] | None:
    """(host view, elements per row) of `name` on a CPU device, resolved once (`store.state_views`);
    None on a device whose memory the host does not address directly."""
    cached = store.state_views.get(name)
    if cached is None:
        dev, buf, t = store.states[name]
        if devices[dev].backend != "cpu":
            return None
        view = devices[dev].host_view(Binding(buf, 0, t.shape, t.strides, t.dtype))
        cached = store.state_views[name] = (view, math.prod(t.shape[1:]))
    return cached


def host_row_bytes(store: PersistentStore, devices: Mapping[str, Device], name: str) -> np.ndarray | None:
    """`name`'s host memory as a (rows, bytes per row) uint8 view, or None where the host does not
    address it or the view is not C-contiguous (then rows are not byte ranges of it)."""
    cached = _host_rows(store, devices, name)
    if cached is None or not cached[0].flags.c_contiguous:
        return None
    view = cached[0]
    return view.reshape(view.shape[0], -1).view(np.uint8) if view.ndim else None


def write_rows(store: PersistentStore, devices: Mapping[str, Device], name: str, row: int, array: np.ndarray) -> None:
    """Write `array` (any shape holding whole rows) into `name` from `row` on.

    Expert staging writes a few rows per layer per step: on a CPU device the tensor's
    host view is resolved once (`store.state_views`) and a write is one slice assignment
    (of bytes, for block-quantized dtypes)."""
    cached = _host_rows(store, devices, name)
    if cached is None:
        _write_rows_device(store, devices, name, row, array)
        return
    view, row_elems = cached
    a = array if type(array) is np.ndarray and array.dtype == view.dtype else np.asarray(array, view.dtype)
    count, rest = divmod(a.size, row_elems)
    if rest or row < 0 or row + count > view.shape[0]:
        raise InputError(f"write_rows: {a.shape} at row {row} does not fit {name!r} {view.shape}")
    dst, src = view[row: row + count], a.reshape((count, *view.shape[1:]))
    if view.dtype.fields is not None and dst.flags.c_contiguous and src.flags.c_contiguous:
        # block-quantized rows (Q4_0, ...) are structured dtypes, which NumPy assigns field by
        # field: ~10x slower than the byte copy they are (40 vs 4 us per 72 KB expert tensor)
        dst.view(np.uint8)[...] = src.view(np.uint8)
    else:
        dst[...] = src


def byte_row_writer(store: PersistentStore, devices: Mapping[str, Device], name: str) -> Callable[[int, np.ndarray], None]:
    """A writer of whole rows of `name` (on a CPU device) given as their bytes: `write(row, data)`
    with `data` uint8 [count, bytes per row]. Expert staging copies rows of a mapped file that are
    already the tensor's bytes: this skips `write_rows`' per-call resolving, dtype and reshaping
    work (~3 us per write, three writes per expert). The host view is looked up in the store on
    every call, so a writer used after the graph is released fails instead of writing freed memory."""
    target = byte_target(store, devices, name)

    def write(row: int, data: np.ndarray) -> None:
        dst = target()
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != dst.shape[1] or row < 0 \
                or row + data.shape[0] > dst.shape[0]:
            raise InputError(f"write_rows: bytes {data.shape} {data.dtype} at row {row} do not fit {name!r} "
                             f"({dst.shape[0]} rows of {dst.shape[1]} bytes)")
        dst[row: row + data.shape[0]] = data

    return write


def byte_run_writer(store: PersistentStore, devices: Mapping[str, Device],
                    name: str) -> Callable[[Sequence[tuple[int, int, int]], np.ndarray], None]:
    """`byte_row_writer` for several runs at once: `write(runs, source)` copies, for each
    (first, row, count) of `runs`, source rows [first, first+count) to rows [row, row+count) of
    `name`; `source` is uint8 [rows, bytes per row]. One lookup and one check of the source per
    call, not per run: a staging call copies each missing expert's three tensors, ~1 us of checks
    each through `byte_row_writer`, beside a copy of ~7-10 us per tensor (moe-lm `mid`)."""
    target = byte_target(store, devices, name)

    def write(runs: Sequence[tuple[int, int, int]], source: np.ndarray) -> None:
        dst = target()
        rows, width = dst.shape
        if source.dtype != np.uint8 or source.ndim != 2 or source.shape[1] != width:
            raise InputError(f"write_rows: bytes {source.shape} {source.dtype} are not rows of {name!r} "
                             f"({rows} rows of {width} bytes)")
        for first, row, count in runs:
            if row < 0 or row + count > rows or first < 0 or first + count > source.shape[0] or count < 0:
                raise InputError(f"write_rows: source rows [{first}, {first + count}) to rows [{row}, "
                                 f"{row + count}) do not fit {name!r} ({rows} rows) or the source "
                                 f"({source.shape[0]} rows)")
            dst[row: row + count] = source[first: first + count]

    return write


def byte_target(store: PersistentStore, devices: Mapping[str, Device], name: str) -> Callable[[], np.ndarray]:
    """`name`'s memory as uint8 [rows, bytes per row], looked up in the store on every call (an
    InputError once the graph is released or where the host does not address it), its byte view
    built again only when the host view changed."""
    # (host view, its byte view [rows, bytes per row]), swapped as one tuple: a writer may be
    # called from the stager's helper thread and then from the staging thread (never both at once)
    memo: list[Any] = [(None, None)]

    def target() -> np.ndarray:
        cached = store.state_views.get(name)
        if cached is None:
            if name not in store.states:
                raise InputError(f"write_rows: no state or cache tensor {name!r} (released?)")
            cached = _host_rows(store, devices, name)
            if cached is None:
                raise InputError(f"write_rows: {name!r} is not in host memory")
        view = cached[0]
        seen, dst = memo[0]
        if seen is not view:
            dst = host_row_bytes(store, devices, name)
            if dst is None:
                raise InputError(f"write_rows: {name!r} is not contiguous in host memory")
            memo[0] = (view, dst)
        return dst

    return target


def _write_rows_device(store: PersistentStore, devices: Mapping[str, Device], name: str, row: int,
                       array: np.ndarray) -> None:
    """`write_rows` through the device's `write` (memory the host does not address directly)."""
    _, _, t = store.states[name]
    array = np.ascontiguousarray(array, to_numpy(t.dtype))
    row_elems = math.prod(t.shape[1:])
    if array.size % row_elems or row < 0 or row + array.size // row_elems > t.shape[0]:
        raise InputError(f"write_rows: {array.shape} at row {row} does not fit {name!r} {t.shape}")
    dev, binding = rows(store, name, row, array.size // row_elems)
    devices[dev].write(binding, array.reshape(binding.shape))
