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
