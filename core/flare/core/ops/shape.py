"""Layout ops. `slice`, `reshape`, `permute`, `transpose` are views (no memory,
no kernel); `contiguous`, `concat` and `pad` produce fresh contiguous tensors."""
from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError
from .registry import OpDef, norm_axis, register


def _any_infer(node, srcs, params):
    return srcs[0].shape, srcs[0].dtype


# -- views -------------------------------------------------------------------
def _slice_range(node, src, params):
    axis = norm_axis(node, "slice", params["axis"], len(src.shape))
    step = params["step"]
    if step < 1:
        raise ShapeError(f"slice step must be >= 1, got {step}", node)
    start, stop, _ = slice(params["start"], params["stop"], step).indices(src.shape[axis])
    n = max(0, (stop - start + step - 1) // step)
    if n == 0:
        raise ShapeError(f"slice [{params['start']}:{params['stop']}:{step}] of axis {axis} (size {src.shape[axis]}) is empty", node)
    return axis, start, step, n


def _slice_infer(node, srcs, params):
    axis, _, _, n = _slice_range(node, srcs[0], params)
    shape = list(srcs[0].shape)
    shape[axis] = n
    return tuple(shape), srcs[0].dtype


def _slice_view(node, src, params):
    axis, start, step, n = _slice_range(node, src, params)
    shape, strides = list(src.shape), list(src.strides)
    shape[axis] = n
    strides[axis] = src.strides[axis] * step
    return tuple(shape), tuple(strides), start * src.strides[axis]


def _slice_ref(x, p):
    idx = [slice(None)] * x[0].ndim
    idx[p["axis"]] = slice(p["start"], p["stop"], p["step"])
    return x[0][tuple(idx)]


register(OpDef("slice", (1, 1), _slice_infer, _slice_ref, defaults={"step": 1},
               required=("axis", "start", "stop"), view=_slice_view))


def _reshape_shape(node, src, params):
    shape = list(params["shape"])
    if shape.count(-1) > 1:
        raise ShapeError(f"reshape to {tuple(shape)}: at most one -1", node)
    if -1 in shape:
        known = math.prod(int(d) for d in shape if d != -1)
        if known == 0 or src.size % known:
            raise ShapeError(f"reshape {src.shape} -> {tuple(shape)}: sizes do not divide", node)
        shape[shape.index(-1)] = src.size // known
    if math.prod(int(d) for d in shape) != src.size:
        raise ShapeError(f"reshape {src.shape} -> {tuple(shape)}: {src.size} elements do not fit", node)
    return tuple(int(d) for d in shape)


def _reshape_infer(node, srcs, params):
    return _reshape_shape(node, srcs[0], params), srcs[0].dtype


def _reshape_view(node, src, params):
    from ..graph import contiguous_strides
    if not src.is_contiguous:
        raise ShapeError(f"reshape of non-contiguous {src.name!r}; insert contiguous first", node)
    shape = _reshape_shape(node, src, params)
    return shape, contiguous_strides(shape), 0


register(OpDef("reshape", (1, 1), _reshape_infer, lambda x, p: x[0].reshape(_reshape_shape("ref", x[0], p)),
               required=("shape",), view=_reshape_view))


def _perm(node, src, axes):
    rank = len(src.shape)
    axes = tuple(norm_axis(node, "permute", a, rank) for a in axes)
    if sorted(axes) != list(range(rank)):
        raise ShapeError(f"permute axes {axes} are not a permutation of rank {rank}", node)
    return axes


def _permute_infer(node, srcs, params):
    axes = _perm(node, srcs[0], params["axes"])
    return tuple(srcs[0].shape[a] for a in axes), srcs[0].dtype


def _permute_view(node, src, params):
    axes = _perm(node, src, params["axes"])
    return tuple(src.shape[a] for a in axes), tuple(src.strides[a] for a in axes), 0


register(OpDef("permute", (1, 1), _permute_infer, lambda x, p: np.transpose(x[0], p["axes"]),
               required=("axes",), view=_permute_view))


def _transpose_axes(node, src, params):
    rank = len(src.shape)
    a0 = norm_axis(node, "transpose", params["axis0"], rank)
    a1 = norm_axis(node, "transpose", params["axis1"], rank)
    axes = list(range(rank))
    axes[a0], axes[a1] = axes[a1], axes[a0]
    return tuple(axes)


register(OpDef("transpose", (1, 1),
               lambda n, s, p: _permute_infer(n, s, {"axes": _transpose_axes(n, s[0], p)}),
               lambda x, p: np.swapaxes(x[0], p["axis0"], p["axis1"]),
               defaults={"axis0": -2, "axis1": -1},
               view=lambda n, s, p: _permute_view(n, s, {"axes": _transpose_axes(n, s, p)})))

# -- copies -------------------------------------------------------------------
register(OpDef("contiguous", (1, 1), _any_infer, lambda x, p: np.ascontiguousarray(x[0])))


def _concat_infer(node, srcs, params):
    a, b = srcs
    if a.dtype != b.dtype:
        raise ShapeError(f"concat of {a.dtype} and {b.dtype}", node)
    if len(a.shape) != len(b.shape):
        raise ShapeError(f"concat of ranks {len(a.shape)} and {len(b.shape)}", node)
    axis = norm_axis(node, "concat", params["axis"], len(a.shape))
    for i, (da, db) in enumerate(zip(a.shape, b.shape)):
        if i != axis and da != db:
            raise ShapeError(f"concat along {axis}: shapes {a.shape} and {b.shape} differ on axis {i}", node)
    shape = list(a.shape)
    shape[axis] += b.shape[axis]
    return tuple(shape), a.dtype


register(OpDef("concat", (2, 2), _concat_infer, lambda x, p: np.concatenate(x, axis=p["axis"]), required=("axis",)))


def _pad_infer(node, srcs, params):
    x = srcs[0]
    pads = params["pads"]
    if len(pads) != len(x.shape) or any(len(pr) != 2 or min(pr) < 0 for pr in pads):
        raise ShapeError(f"pad needs one non-negative (before, after) pair per axis of {x.shape}, got {pads}", node)
    if params["mode"] not in ("constant", "reflect"):
        raise ShapeError(f"pad mode {params['mode']!r} (constant or reflect)", node)
    if params["mode"] == "reflect":
        for d, (lo, hi) in zip(x.shape, pads):
            if lo >= d or hi >= d:
                raise ShapeError(f"reflect pad {(lo, hi)} needs it smaller than the axis size {d}", node)
    return tuple(d + lo + hi for d, (lo, hi) in zip(x.shape, pads)), x.dtype


def _pad_ref(x, p):
    pads = [tuple(pr) for pr in p["pads"]]
    if p["mode"] == "reflect":
        return np.pad(x[0], pads, mode="reflect")
    return np.pad(x[0], pads, mode="constant", constant_values=p["value"]).astype(x[0].dtype)


register(OpDef("pad", (1, 1), _pad_infer, _pad_ref, defaults={"mode": "constant", "value": 0.0}, required=("pads",)))
