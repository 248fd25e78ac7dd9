"""CPU kernels of flare.core.ops.indexing (take, take_along_axis, expand, flip, tile).

Same contract as kernels.py; indices are checked (negative ones wrapped once)
before NumPy indexes, so an index out of range raises instead of reading
outside the tensor. Registered into the CPU kernel table on import.
"""
from __future__ import annotations

import numpy as np

from flare.core.ops.indexing import checked_indices

from .kernels import KERNELS


def _take(out, x, p):
    axis = p["axis"] % x[0].ndim
    np.take(x[0], checked_indices(x[1], x[0].shape[axis], "take"), axis=axis, out=out.reshape(
        (*x[0].shape[:axis], *x[1].shape, *x[0].shape[axis + 1:])))


def _take_along(out, x, p):
    axis = p["axis"] % x[0].ndim
    out[...] = np.take_along_axis(x[0], checked_indices(x[1], x[0].shape[axis], "take_along_axis"), axis=axis)


KERNELS.update(
    take=_take,
    take_along_axis=_take_along,
    expand=lambda out, x, p: np.copyto(out, np.broadcast_to(x[0], out.shape)),
    flip=lambda out, x, p: np.copyto(out, np.flip(x[0], p["axis"])),
    tile=lambda out, x, p: np.copyto(out, np.tile(x[0], tuple(p["repeats"]))),
)


def _gather_nd(out, x, p):
    from flare.core.ops.indexing import gather_nd_ref

    out[...] = gather_nd_ref(x, p).reshape(out.shape)


def _scatter_nd(out, x, p):
    """Plain replacement at distinct index tuples (Piper's duration predictor, 30 a sentence): one
    fancy-index assignment. The reference's loop per tuple (in order, so a repeated tuple's last
    update wins) cost ~0.15 ms a call there; repeats and reductions still take it."""
    from flare.core.ops.indexing import _nd_rows, scatter_nd_ref

    data, idx, upd = x
    k = idx.shape[-1]
    if p["mode"] == "none" and 0 < k <= data.ndim and idx.size:
        ix = _nd_rows(data, idx, 0)[1][0]  # [n, k], negatives wrapped, bounds checked
        flat = np.ravel_multi_index(tuple(ix.T), data.shape[:k])
        if np.unique(flat).size == flat.size:
            np.copyto(out, data)
            out[tuple(ix.T)] = upd.reshape((-1, *data.shape[k:]))
            return
    out[...] = scatter_nd_ref(x, p)


KERNELS.update(gather_nd=_gather_nd, scatter_nd=_scatter_nd)


def _scatter_elements(out, x, p):
    from flare.core.ops.indexing import scatter_elements_ref

    out[...] = scatter_elements_ref(x, p)


KERNELS["scatter_elements"] = _scatter_elements
