"""Indexing and layout copies over any axis: take, take_along_axis, expand, flip, tile.

The older `gather` and `get_rows` index only the last axis or rows of a
table; ONNX's Gather, GatherElements, Expand and Tile index or repeat along
any axis, and ONNX Slice may step backwards (`flip` then a forward `slice`).
Every op here writes a fresh contiguous output in the source's dtype.
Indices may be negative (counted from the end, as ONNX allows); an index out
of range is an IndexError from the kernel, never a read outside the tensor.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from .registry import PARAMS, OpDef, _int_list, broadcast, need_dtype, norm_axis, register

PARAMS.setdefault("repeats", (lambda v: _int_list(v) and 1 <= len(v) <= 4 and all(r >= 1 for r in v),
                              "a list of 1..4 positive integers"))


def _take_infer(node, srcs, params):
    x, idx = srcs
    need_dtype(node, "take", idx, ("i32", "i64"))
    axis = norm_axis(node, "take", params["axis"], len(x.shape))
    return (*x.shape[:axis], *idx.shape, *x.shape[axis + 1:]), x.dtype


def checked_indices(idx: np.ndarray, size: int, op: str) -> np.ndarray:
    """Negative indices wrapped once; anything still outside 0..size-1 is an IndexError."""
    idx = np.where(idx < 0, idx + size, idx)
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        raise IndexError(f"{op}: index outside -{size}..{size - 1}")
    return idx.astype(np.intp)


def _take_ref(x, p):
    axis = p["axis"] % x[0].ndim
    return np.take(x[0], checked_indices(x[1], x[0].shape[axis], "take"), axis=axis)


register(OpDef("take", (2, 2), _take_infer, _take_ref, required=("axis",),
               doc="np.take along `axis` (ONNX Gather)"))


def _take_along_infer(node, srcs, params):
    x, idx = srcs
    need_dtype(node, "take_along_axis", idx, ("i32", "i64"))
    norm_axis(node, "take_along_axis", params["axis"], len(x.shape))
    if len(idx.shape) != len(x.shape):
        raise ShapeError(f"take_along_axis: indices rank {len(idx.shape)} != data rank {len(x.shape)}", node)
    return idx.shape, x.dtype


def _take_along_ref(x, p):
    axis = p["axis"] % x[0].ndim
    return np.take_along_axis(x[0], checked_indices(x[1], x[0].shape[axis], "take_along_axis"), axis=axis)


register(OpDef("take_along_axis", (2, 2), _take_along_infer, _take_along_ref, required=("axis",),
               doc="np.take_along_axis (ONNX GatherElements)"))


def _expand_infer(node, srcs, params):
    return broadcast(node, "expand", srcs[0].shape, params["shape"]), srcs[0].dtype


register(OpDef("expand", (1, 1), _expand_infer,
               lambda x, p: np.ascontiguousarray(np.broadcast_to(x[0], np.broadcast_shapes(x[0].shape, tuple(p["shape"])))),
               required=("shape",), doc="broadcast to broadcast(x.shape, shape), copied"))


def _flip_infer(node, srcs, params):
    norm_axis(node, "flip", params["axis"], len(srcs[0].shape))
    return srcs[0].shape, srcs[0].dtype


register(OpDef("flip", (1, 1), _flip_infer, lambda x, p: np.ascontiguousarray(np.flip(x[0], p["axis"])),
               required=("axis",)))


def _tile_infer(node, srcs, params):
    x = srcs[0]
    reps = tuple(params["repeats"])
    if len(reps) != len(x.shape):
        raise ShapeError(f"tile: {len(reps)} repeats for rank {len(x.shape)}", node)
    return tuple(d * r for d, r in zip(x.shape, reps)), x.dtype


register(OpDef("tile", (1, 1), _tile_infer, lambda x, p: np.tile(x[0], tuple(p["repeats"])), required=("repeats",)))


# -- gather_nd / scatter_nd (ONNX GatherND / ScatterND) ----------------------------------
PARAMS.setdefault("batch_dims", (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 3,
                                 "an integer in 0..3"))


def _gather_nd_infer(node, srcs, params):
    x, idx = srcs
    need_dtype(node, "gather_nd", idx, ("i32", "i64"))
    b = params["batch_dims"]
    k = idx.shape[-1]
    if b + k > len(x.shape) or tuple(x.shape[:b]) != tuple(idx.shape[:b]):
        raise ShapeError(f"gather_nd: indices {idx.shape} (batch_dims={b}) do not fit data {x.shape}", node)
    shape = (*idx.shape[:-1], *x.shape[b + k:])
    return shape or (1,), x.dtype


def _nd_rows(data: np.ndarray, idx: np.ndarray, b: int):
    """(data, index tuples) per batch entry, negatives wrapped and checked."""
    nb = int(np.prod(data.shape[:b], dtype=np.int64)) if b else 1
    d = data.reshape((nb, *data.shape[b:]))
    k = idx.shape[-1]
    ix = idx.reshape(nb, -1, k)
    dims = np.array(d.shape[1:1 + k])
    ix = np.where(ix < 0, ix + dims, ix)
    if ix.size and ((ix < 0).any() or (ix >= dims).any()):
        raise IndexError(f"gather_nd/scatter_nd: an index outside the data's shape {data.shape}")
    return d, ix.astype(np.intp)


def gather_nd_ref(x, p):
    data, idx = x
    b = p["batch_dims"]
    d, ix = _nd_rows(data, idx, b)
    rows = [d[i][tuple(ix[i].T)] for i in range(d.shape[0])]
    shape = (*idx.shape[:-1], *data.shape[b + idx.shape[-1]:])
    return np.stack(rows).reshape(shape or (1,))


register(OpDef("gather_nd", (2, 2), _gather_nd_infer, gather_nd_ref, defaults={"batch_dims": 0},
               doc="ONNX GatherND: slices of data at index tuples"))


def _scatter_nd_infer(node, srcs, params):
    x, idx, upd = srcs
    need_dtype(node, "scatter_nd", idx, ("i32", "i64"))
    if upd.dtype != x.dtype:
        raise ShapeError(f"scatter_nd: updates {upd.dtype} into data {x.dtype}", node)
    k = idx.shape[-1]
    want = (*idx.shape[:-1], *x.shape[k:])
    if k > len(x.shape) or tuple(upd.shape) != (want or (1,)):
        raise ShapeError(f"scatter_nd: updates {upd.shape} must be {want} for indices {idx.shape} into {x.shape}", node)
    if params["mode"] not in ("none", "add", "mul", "max", "min"):
        raise ShapeError(f"scatter_nd reduction {params['mode']!r} (none, add, mul, max, min)", node)
    return x.shape, x.dtype


def scatter_nd_ref(x, p):
    data, idx, upd = x
    out = np.array(data, copy=True)
    _, ix = _nd_rows(data, idx, 0)
    ix = ix[0]
    k = idx.shape[-1]
    upd = upd.reshape((-1, *data.shape[k:]))
    fn = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}.get(p["mode"])
    for row, u in zip(ix, upd):  # in order: later updates of one index win (ONNX leaves it undefined)
        at = tuple(row)
        out[at] = u if fn is None else fn(out[at], u)
    return out


register(OpDef("scatter_nd", (3, 3), _scatter_nd_infer, scatter_nd_ref, defaults={"mode": "none"},
               doc="ONNX ScatterND: a copy of data with slices at index tuples replaced (or reduced)"))


def _scatter_elements_infer(node, srcs, params):
    x, idx, upd = srcs
    need_dtype(node, "scatter_elements", idx, ("i32", "i64"))
    norm_axis(node, "scatter_elements", params["axis"], len(x.shape))
    if len(idx.shape) != len(x.shape) or tuple(upd.shape) != tuple(idx.shape) or upd.dtype != x.dtype:
        raise ShapeError(f"scatter_elements: indices {idx.shape} and updates {upd.shape} {upd.dtype} must match "
                         f"each other and the rank of data {x.shape} {x.dtype}", node)
    if params["mode"] not in ("none", "add", "mul", "max", "min"):
        raise ShapeError(f"scatter_elements reduction {params['mode']!r} (none, add, mul, max, min)", node)
    return x.shape, x.dtype


def scatter_elements_ref(x, p):
    data, idx, upd = x
    axis = p["axis"] % data.ndim
    out = np.array(data, copy=True)
    where = list(np.indices(idx.shape, sparse=True))
    where[axis] = checked_indices(idx, data.shape[axis], "scatter_elements")
    where = tuple(np.broadcast_arrays(*where))
    fn = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}.get(p["mode"])
    if fn is None:
        out[where] = upd  # repeated indices: the last update wins, as NumPy assigns in order
    else:
        fn.at(out, where, upd)
    return out


register(OpDef("scatter_elements", (3, 3), _scatter_elements_infer, scatter_elements_ref,
               defaults={"mode": "none"}, required=("axis",),
               doc="ONNX ScatterElements: a copy of data with updates written along `axis` at indices"))
