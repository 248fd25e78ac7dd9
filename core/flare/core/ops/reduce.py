"""Reductions over one axis: sum, mean, max, argmax, and top_k over the last axis."""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from .registry import OpDef, need_dtype, norm_axis, register


def _reduced_shape(node, op, x, axis, keepdims):
    axis = norm_axis(node, op, axis, len(x.shape))
    shape = list(x.shape)
    if keepdims:
        shape[axis] = 1
    else:
        del shape[axis]
    return tuple(shape) or (1,)


def _reduce_infer(op):
    def infer(node, srcs, params):
        need_dtype(node, op, srcs[0], ("f32",))
        return _reduced_shape(node, op, srcs[0], params["axis"], params["keepdims"]), "f32"
    return infer


def _reduce_ref(fn):
    def ref(x, p):
        out = fn(x[0].astype(np.float64), axis=p["axis"], keepdims=p["keepdims"])
        return np.asarray(out, np.float32).reshape(_np_reduced(x[0].shape, p))
    return ref


def _np_reduced(shape, p):
    axis = p["axis"] % len(shape)
    out = list(shape)
    if p.get("keepdims"):
        out[axis] = 1
    else:
        del out[axis]
    return tuple(out) or (1,)


for _name, _fn in {"sum": np.sum, "mean": np.mean, "max": np.max}.items():
    register(OpDef(_name, (1, 1), _reduce_infer(_name), _reduce_ref(_fn), defaults={"keepdims": False}, required=("axis",)))


def _argmax_infer(node, srcs, params):
    need_dtype(node, "argmax", srcs[0], ("f32",))
    return _reduced_shape(node, "argmax", srcs[0], params["axis"], False), "i32"


register(OpDef("argmax", (1, 1), _argmax_infer,
               lambda x, p: np.argmax(x[0], axis=p["axis"]).astype(np.int32).reshape(_np_reduced(x[0].shape, {"axis": p["axis"]})),
               defaults={"axis": -1}))


def _top_k_infer(node, srcs, params):
    x = srcs[0]
    need_dtype(node, "top_k", x, ("f32",))
    k = params["k"]
    if not 1 <= k <= x.shape[-1]:
        raise ShapeError(f"top_k k={k} must be in 1..{x.shape[-1]}", node)
    return (*x.shape[:-1], k), "i32"


def _top_k_ref(x, p):
    # stable sort of -x: descending values, lower index first among equals
    order = np.argsort(-x[0], axis=-1, kind="stable")
    return order[..., : p["k"]].astype(np.int32)


register(OpDef("top_k", (1, 1), _top_k_infer, _top_k_ref, required=("k",)))
