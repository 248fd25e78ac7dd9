"""2-D convolution and pooling over [B, C, H, W] (NCHW, as ONNX and PyTorch).

`conv2d` is the 2-D sibling of `conv1d` with groups, per-axis strides,
dilations and explicit (before, after) zero padding, and an optional third
source, a bias [O] (the CPU's native path adds it while it writes the output,
saving a pass over it).
`max_pool2d` / `avg_pool2d` take a kernel, strides, dilations, pads and
`ceil_mode` (the last window may overhang the end when it starts inside the
input or its left padding, the PyTorch/ONNX rule); padded cells never win a
max, and `avg_pool2d` counts them only with `count_include_pad`.
1-D convolutions and pools of imported graphs run as these with H = 1.
`grid_sample` samples [N, C, H, W] at normalized grid points (ONNX GridSample,
2-D: linear, nearest or cubic; zeros, border or reflection padding).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError
from .registry import PARAMS, OpDef, need_dtype, need_rank, register

_pair = (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(d, int) and 1 <= d <= 1 << 16 for d in v))
PARAMS.setdefault("strides", (_pair, "two integers in 1..65536"))
PARAMS.setdefault("dilations", (_pair, "two integers in 1..65536"))
PARAMS.setdefault("kernel", (_pair, "two integers in 1..65536"))
PARAMS.setdefault("groups", (lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 16,
                             "an integer in 1..65536"))
PARAMS.setdefault("ceil_mode", (lambda v: isinstance(v, bool), "true or false"))
PARAMS.setdefault("count_include_pad", (lambda v: isinstance(v, bool), "true or false"))


def out_size(n: int, k: int, s: int, d: int, lo: int, hi: int, ceil_mode: bool = False) -> int:
    """Output length of one spatial axis (the ONNX/PyTorch formula, ceil_mode included)."""
    span = n + lo + hi - d * (k - 1) - 1
    if span < 0:
        return 0
    if not ceil_mode:
        return span // s + 1
    out = math.ceil(span / s) + 1
    if (out - 1) * s >= n + lo:  # the last window would start in the right padding
        out -= 1
    return out


def _pads(node, op, params):
    pads = params["pads"]
    if len(pads) != 2:
        raise ShapeError(f"{op}: pads needs two (before, after) pairs (H, W), got {pads}", node)
    return pads


def _conv2d_infer(node, srcs, params):
    x, w = srcs[:2]
    if len(srcs) == 3:
        need_dtype(node, "conv2d", srcs[2], ("f32",))
        if tuple(srcs[2].shape) != (w.shape[0],):
            raise ShapeError(f"conv2d: bias {srcs[2].shape} must be [{w.shape[0]}] (one per output channel)", node)
    for t in (x, w):
        need_dtype(node, "conv2d", t, ("f32",))
        need_rank(node, "conv2d", t, (4,))
    g = params["groups"]
    if x.shape[1] % g or w.shape[0] % g or w.shape[1] * g != x.shape[1]:
        raise ShapeError(f"conv2d: input {x.shape} and weight {w.shape} do not fit groups={g}", node)
    (pt, pb), (pl, pr) = _pads(node, "conv2d", params)
    ho = out_size(x.shape[2], w.shape[2], params["strides"][0], params["dilations"][0], pt, pb)
    wo = out_size(x.shape[3], w.shape[3], params["strides"][1], params["dilations"][1], pl, pr)
    if ho < 1 or wo < 1:
        raise ShapeError(f"conv2d: kernel {w.shape[2:]} does not fit input {x.shape[2:]} with pads {params['pads']}", node)
    return (x.shape[0], w.shape[0], ho, wo), "f32"


def windows(x: np.ndarray, kernel, strides, dilations, out_hw) -> np.ndarray:
    """[B, C, Ho, Wo, kh, kw] strided view of an already padded x (no copy)."""
    b, c, _, _ = x.shape
    sb, sc, sh, sw = x.strides
    (kh, kw), (st_h, st_w), (dh, dw) = kernel, strides, dilations
    return np.lib.stride_tricks.as_strided(
        x, (b, c, out_hw[0], out_hw[1], kh, kw), (sb, sc, sh * st_h, sw * st_w, sh * dh, sw * dw), writeable=False)


def conv2d_ref(x, p):
    v, w = x[0].astype(np.float64), x[1].astype(np.float64)
    (pt, pb), (pl, pr) = p["pads"]
    v = np.pad(v, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    ho = out_size(x[0].shape[2], w.shape[2], p["strides"][0], p["dilations"][0], pt, pb)
    wo = out_size(x[0].shape[3], w.shape[3], p["strides"][1], p["dilations"][1], pl, pr)
    win = windows(v, w.shape[2:], p["strides"], p["dilations"], (ho, wo))
    g = p["groups"]
    cg, og = w.shape[1], w.shape[0] // g
    outs = [np.einsum("bchwij,ocij->bohw", win[:, i * cg:(i + 1) * cg], w[i * og:(i + 1) * og]) for i in range(g)]
    out = np.concatenate(outs, axis=1)
    if len(x) == 3:
        out = out + x[2].astype(np.float64).reshape(1, -1, 1, 1)
    return out.astype(np.float32)


register(OpDef("conv2d", (2, 3), _conv2d_infer, conv2d_ref,
               defaults={"strides": (1, 1), "dilations": (1, 1), "pads": ((0, 0), (0, 0)), "groups": 1}))


def _pool_infer(op):
    def infer(node, srcs, params):
        x = srcs[0]
        need_dtype(node, op, x, ("f32",))
        need_rank(node, op, x, (4,))
        (pt, pb), (pl, pr) = _pads(node, op, params)
        k, s, d = params["kernel"], params["strides"], params["dilations"]
        if max(pt, pb) >= k[0] * d[0] and k[0] > 1 or max(pl, pr) >= k[1] * d[1] and k[1] > 1:
            raise ShapeError(f"{op}: pads {params['pads']} must be smaller than the kernel {k}", node)
        ho = out_size(x.shape[2], k[0], s[0], d[0], pt, pb, params["ceil_mode"])
        wo = out_size(x.shape[3], k[1], s[1], d[1], pl, pr, params["ceil_mode"])
        if ho < 1 or wo < 1:
            raise ShapeError(f"{op}: kernel {k} does not fit input {x.shape[2:]}", node)
        return (x.shape[0], x.shape[1], ho, wo), "f32"
    return infer


def pool_geometry(shape, p):
    """Output size and the extra right/bottom padding ceil_mode needs."""
    (pt, pb), (pl, pr) = p["pads"]
    k, s, d = p["kernel"], p["strides"], p["dilations"]
    ho = out_size(shape[2], k[0], s[0], d[0], pt, pb, p["ceil_mode"])
    wo = out_size(shape[3], k[1], s[1], d[1], pl, pr, p["ceil_mode"])
    need_h = (ho - 1) * s[0] + d[0] * (k[0] - 1) + 1
    need_w = (wo - 1) * s[1] + d[1] * (k[1] - 1) + 1
    extra_b = max(0, need_h - (shape[2] + pt + pb))
    extra_r = max(0, need_w - (shape[3] + pl + pr))
    return ho, wo, ((0, 0), (0, 0), (pt, pb + extra_b), (pl, pr + extra_r)), ((0, 0), (0, 0), (0, extra_b), (0, extra_r))


def max_pool2d_ref(x, p):
    ho, wo, pads, _ = pool_geometry(x[0].shape, p)
    v = np.pad(x[0].astype(np.float64), pads, constant_values=-np.inf)
    return windows(v, p["kernel"], p["strides"], p["dilations"], (ho, wo)).max(axis=(4, 5)).astype(np.float32)


def avg_pool2d_ref(x, p):
    ho, wo, pads, extra = pool_geometry(x[0].shape, p)
    v = np.pad(x[0].astype(np.float64), pads)
    total = windows(v, p["kernel"], p["strides"], p["dilations"], (ho, wo)).sum(axis=(4, 5))
    ones = np.ones((1, 1, *x[0].shape[2:]))
    if p["count_include_pad"]:  # the explicit pads count, the ceil_mode overhang does not
        (pt, pb), (pl, pr) = p["pads"]
        ones = np.pad(ones, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=1.0)
        ones = np.pad(ones, extra)
    else:
        ones = np.pad(ones, pads)
    count = windows(ones, p["kernel"], p["strides"], p["dilations"], (ho, wo)).sum(axis=(4, 5))
    return (total / count).astype(np.float32)


_POOL_DEFAULTS = {"strides": (1, 1), "dilations": (1, 1), "pads": ((0, 0), (0, 0)), "ceil_mode": False}
register(OpDef("max_pool2d", (1, 1), _pool_infer("max_pool2d"), max_pool2d_ref, defaults=_POOL_DEFAULTS,
               required=("kernel",)))
register(OpDef("avg_pool2d", (1, 1), _pool_infer("avg_pool2d"), avg_pool2d_ref,
               defaults={**_POOL_DEFAULTS, "count_include_pad": False}, required=("kernel",)))


# -- grid_sample -------------------------------------------------------------------------
PARAMS.setdefault("padding_mode", (lambda v: v in ("zeros", "border", "reflection"), "zeros, border or reflection"))
PARAMS.setdefault("align_corners", (lambda v: isinstance(v, bool), "true or false"))
GRID_MODES = ("linear", "nearest", "cubic")


def _reflect(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Reflect coordinates by the near border until they fall inside [lo, hi]."""
    rng = hi - lo
    below, above = x < lo, x > hi
    dx = np.where(below, lo - x, x - hi)
    n = np.trunc(dx / rng) if rng > 0 else np.zeros_like(dx)
    r = dx - n * rng
    even = n % 2 == 0
    return np.where(below, np.where(even, lo + r, hi - r), np.where(above, np.where(even, hi - r, lo + r), x))


def _cubic_weights(t: np.ndarray) -> list[np.ndarray]:
    """Keys' cubic convolution weights (A = -0.75) of the taps at -1, 0, 1, 2 for fraction t."""
    a = -0.75
    return [((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
            ((a + 2) * t - (a + 3)) * t * t + 1,
            ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1,
            ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a]


def grid_sample_ref(x: np.ndarray, grid: np.ndarray, mode: str, padding_mode: str, align_corners: bool) -> np.ndarray:
    """ONNX GridSample over [N, C, H, W] at the normalized (x, y) points of grid [N, Ho, Wo, 2],
    vectorized in float64: the coordinate mapping, padding modes and cubic taps of onnx's
    reference implementation, rounded once to f32. Used as the CPU kernel too."""
    n, c, h, w = x.shape
    dims = (h, w)
    lo = [0.0, 0.0] if align_corners else [-0.5, -0.5]
    hi = [d - 1.0 for d in dims] if align_corners else [d - 0.5 for d in dims]
    coords = []
    for axis, norm in enumerate((grid[..., 1].astype(np.float64), grid[..., 0].astype(np.float64))):
        d = dims[axis]
        v = (norm + 1) / 2 * (d - 1) if align_corners else ((norm + 1) * d - 1) / 2
        if mode == "nearest":
            v = np.rint(v)
        outside = (v < lo[axis]) | (v > hi[axis])
        if padding_mode == "border":
            v = np.where(outside, np.clip(v, 0, d - 1), v)
        elif padding_mode == "reflection":
            v = np.where(outside, _reflect(v, lo[axis], hi[axis]), v)
        coords.append(v)
    batch = np.arange(n)[:, None, None]

    def taps(v, axis):
        """(index, weight) per tap of one axis, indices already mapped by the padding mode."""
        d = dims[axis]
        if mode == "nearest":
            pairs = [(np.trunc(v).astype(np.int64), np.ones_like(v))]
        else:
            f = np.floor(v)
            t = v - f
            if mode == "linear":
                pairs = [(f.astype(np.int64), 1 - t), (f.astype(np.int64) + 1, t)]
            else:
                ws = _cubic_weights(t)
                pairs = [(f.astype(np.int64) + k - 1, ws[k]) for k in range(4)]
        out = []
        for idx, wt in pairs:
            if padding_mode == "zeros":
                valid = (idx >= 0) & (idx < d)
                out.append((np.clip(idx, 0, d - 1), wt * valid))
            elif padding_mode == "border":
                out.append((np.clip(idx, 0, d - 1), wt))
            else:
                out.append((np.trunc(_reflect(idx.astype(np.float64), lo[axis], hi[axis])).astype(np.int64), wt))
        return out

    acc = np.zeros((n, grid.shape[1], grid.shape[2], c))
    for iy, wy in taps(coords[0], 0):
        for ix, wx in taps(coords[1], 1):
            pix = x[batch, :, iy, ix].astype(np.float64)  # [N, Ho, Wo, C]
            acc += pix * (wy * wx)[..., None]
    return np.ascontiguousarray(np.moveaxis(acc, 3, 1)).astype(np.float32)


def _grid_sample_infer(node, srcs, params):
    x, grid = srcs
    need_dtype(node, "grid_sample", x, ("f32",))
    need_dtype(node, "grid_sample", grid, ("f32",))
    need_rank(node, "grid_sample", x, (4,))
    need_rank(node, "grid_sample", grid, (4,))
    if grid.shape[0] != x.shape[0] or grid.shape[3] != 2:
        raise ShapeError(f"grid_sample: grid {grid.shape} must be [N={x.shape[0]}, Ho, Wo, 2]", node)
    if params["mode"] not in GRID_MODES:
        raise ShapeError(f"grid_sample: mode {params['mode']!r} is not one of {', '.join(GRID_MODES)}", node)
    return (x.shape[0], x.shape[1], grid.shape[1], grid.shape[2]), "f32"


register(OpDef("grid_sample", (2, 2), _grid_sample_infer,
               lambda s, p: grid_sample_ref(s[0], s[1], p["mode"], p["padding_mode"], p["align_corners"]),
               defaults={"mode": "linear", "padding_mode": "zeros", "align_corners": False}))
