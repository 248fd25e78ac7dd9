"""CPU kernels of flare.core.ops.spatial (conv2d, max_pool2d, avg_pool2d, grid_sample) in float32.

conv2d is im2col by strided view plus one tensordot per group (BLAS does the
work); the pools reduce the same windows view. Padding copies the input once
into a temporary, the price of keeping the windows a plain strided view.
Registered into the CPU kernel table on import.
"""
from __future__ import annotations

import numpy as np

from flare.core.ops.spatial import grid_sample_ref, pool_geometry, windows

from .kernels import KERNELS


def _conv2d(out, x, p):
    v, w = x
    (pt, pb), (pl, pr) = p["pads"]
    if pt or pb or pl or pr:
        v = np.pad(v, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    ho, wo = out.shape[2:]
    win = windows(v, w.shape[2:], p["strides"], p["dilations"], (ho, wo))  # [B, C, Ho, Wo, kh, kw]
    g = p["groups"]
    cg, og = w.shape[1], w.shape[0] // g
    for i in range(g):
        part = np.tensordot(win[:, i * cg:(i + 1) * cg], w[i * og:(i + 1) * og], axes=([1, 4, 5], [1, 2, 3]))
        out[:, i * og:(i + 1) * og] = np.moveaxis(part, 3, 1)  # [B, Ho, Wo, O] -> [B, O, Ho, Wo]


def _max_pool2d(out, x, p):
    ho, wo, pads, _ = pool_geometry(x[0].shape, p)
    v = np.pad(x[0], pads, constant_values=-np.inf) if any(a or b for a, b in pads) else x[0]
    np.max(windows(v, p["kernel"], p["strides"], p["dilations"], (ho, wo)), axis=(4, 5), out=out)


def _avg_pool2d(out, x, p):
    from flare.core.ops.spatial import avg_pool2d_ref

    ho, wo, pads, _ = pool_geometry(x[0].shape, p)
    if not any(a or b for a, b in pads):
        np.mean(windows(x[0], p["kernel"], p["strides"], p["dilations"], (ho, wo)), axis=(4, 5), out=out)
    else:  # the divisor varies per window: the reference's counting, then one cast
        out[...] = avg_pool2d_ref([x[0]], p)


KERNELS.update(conv2d=_conv2d, max_pool2d=_max_pool2d, avg_pool2d=_avg_pool2d)


def _grid_sample(out, x, p):
    out[...] = grid_sample_ref(x[0], x[1], p["mode"], p["padding_mode"], p["align_corners"])  # the reference is the kernel


KERNELS["grid_sample"] = _grid_sample
