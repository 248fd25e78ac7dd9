"""CPU kernels of flare.core.ops.spatial (conv2d, max_pool2d, avg_pool2d, grid_sample) in float32.

conv2d is im2col by strided view plus one tensordot per group (BLAS does the
work); the pools reduce the same windows view. Padding copies the input once
into a temporary, the price of keeping the windows a plain strided view.
Registered into the CPU kernel table on import.

A 1-D convolution (H = 1: how imported graphs run Conv1d, and ConvTranspose1d
after its zero upsampling) with one group also has a native lowering: the C
executor's `conv1d` command (im2col rows, one GEMM, a transpose; kernels.c),
so the decoders of audio models do not pay NumPy's copies of the window view.
"""
from __future__ import annotations

import numpy as np

from flare.core.ops.spatial import grid_sample_ref, pool_geometry, windows

from .kernels import KERNELS
from .lowering import CONV1D_RESIDUAL, cmd, conv1d_direct, conv1d_rows, conv1d_scratch, estrides, translator


def _conv2d(out, x, p):
    _conv2d_nobias(out, x[:2], p)
    if len(x) == 3:
        out += x[2].reshape(1, -1, 1, 1)


def _conv2d_nobias(out, x, p):
    v, w = x
    g = p["groups"]
    if g > 1 and w.shape[1] == 1 and w.shape[0] == g and w.shape[2] * w.shape[3] <= 32:
        _depthwise(out, v, w, p)
        return
    (pt, pb), (pl, pr) = p["pads"]
    if pt or pb or pl or pr:
        v = np.pad(v, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    ho, wo = out.shape[2:]
    win = windows(v, w.shape[2:], p["strides"], p["dilations"], (ho, wo))  # [B, C, Ho, Wo, kh, kw]
    cg, og = w.shape[1], w.shape[0] // g
    if g > 4:  # many groups (depthwise): one einsum over all of them, not a tensordot per group
        b = win.shape[0]
        wg = win.reshape(b, g, cg, ho, wo, *w.shape[2:])
        res = np.einsum("bgchwij,gocij->bgohw", wg, w.reshape(g, og, cg, *w.shape[2:]))
        out[...] = res.reshape(out.shape)
        return
    for i in range(g):
        part = np.tensordot(win[:, i * cg:(i + 1) * cg], w[i * og:(i + 1) * og], axes=([1, 4, 5], [1, 2, 3]))
        out[:, i * og:(i + 1) * og] = np.moveaxis(part, 3, 1)  # [B, Ho, Wo, O] -> [B, O, Ho, Wo]


def _taps(n_out: int, n_in: int, step: int, offset: int) -> tuple[int, int]:
    """Outputs [o0, o1) whose input o*step + offset lies in [0, n_in)."""
    o0 = max(0, -(offset // step))  # ceil(-offset / step)
    o1 = min(n_out, (n_in - 1 - offset) // step + 1) if n_in - 1 - offset >= 0 else 0
    return o0, max(o0, o1)


def _depthwise(out, v, w, p):
    """One input channel per output channel (Piper's duration predictor: 192 channels, K 3,
    dilations 1/3/9): a multiply-add of a strided view of x per tap, over the outputs whose tap
    lands inside x (zero padding contributes nothing, so x is not padded). The grouped einsum
    built the [B, G, 1, Ho, Wo, kh, kw] product per channel and cost ~20x this at those sizes,
    np.pad as much again."""
    (pt, _), (pl, _) = p["pads"]
    (sh, sw), (dh, dw) = p["strides"], p["dilations"]
    ho, wo = out.shape[2:]
    h, wd = v.shape[2:]
    out.fill(0)
    for i in range(w.shape[2]):
        h0, h1 = _taps(ho, h, sh, i * dh - pt)
        for j in range(w.shape[3]):
            w0, w1 = _taps(wo, wd, sw, j * dw - pl)
            if h1 <= h0 or w1 <= w0:
                continue
            a, b = h0 * sh + i * dh - pt, w0 * sw + j * dw - pl
            xs = v[:, :, a:a + (h1 - h0 - 1) * sh + 1:sh, b:b + (w1 - w0 - 1) * sw + 1:sw]
            out[:, :, h0:h1, w0:w1] += xs * w[:, 0, i, j].reshape(1, -1, 1, 1)


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


def _conv_add(out, x, p):
    """The fused conv_add's NumPy kernel: the convolution into a temporary, then the residual sum."""
    y = np.empty((out.shape[0], out.shape[1], 1, out.shape[-1]), np.float32)
    _conv2d(y, x[:-1], p)
    np.add(y.reshape(out.shape), x[-1], out=out)


KERNELS["conv_add"] = _conv_add


def _one_row(p, x_shape, w_shape) -> bool:
    """Whether conv2d params `p` over x and w of these shapes are a 1-D convolution the native
    conv1d command takes: one group, x and the kernel one row high, no padding over H. Asked of
    Tensors at plan time (conv_add_native) and of arrays at compile time (_conv2d_native)."""
    return p["groups"] == 1 and x_shape[2] == 1 and w_shape[2] == 1 and tuple(p["pads"][0]) == (0, 0)


def conv_add_native(node) -> bool:
    """Whether fused conv_add `node` runs as the native conv1d command (so the device takes the
    fusion): a one-row convolution (_one_row) and a contiguous residual."""
    return _one_row(node.params, node.srcs[0].shape, node.srcs[1].shape) and node.srcs[-1].is_contiguous


@translator("conv_add")
def _conv_add_native(node, out, srcs):
    """conv_add as conv2d's conv1d command whose output starts from the residual (flags bit 4,
    src[3]; native/conv1d.h): the sum costs no pass of its own."""
    res = srcs[-1]
    if res.dtype != np.float32 or not res.flags.c_contiguous or not out.flags.c_contiguous:
        return None
    b, cout, lout = out.shape[0], out.shape[1], out.shape[-1]
    cmds = _conv2d_native(node, out.reshape(b, cout, 1, lout), srcs[:-1])
    if cmds is None:
        return None
    c = cmds[0]
    c["src"] = [*c["src"], res.reshape(b, cout, 1, lout)]   # [x, w, bias or None, residual]
    c["flags"] = int(c["flags"]) | CONV1D_RESIDUAL
    return cmds


@translator("conv2d")
def _conv2d_native(node, out, srcs):
    """conv2d over [B, C, 1, W] with one group as the native `conv1d` command; None (the NumPy
    kernel above) for 2-D windows, groups, or layouts the command cannot take.

    A bias (third source) is written into the output first and the GEMM adds to it.
    Asymmetric padding needs no parameter of its own: the command pads by the left amount
    and the output width (from the node) decides how far right the windows reach, reading
    zeros past the input's end."""
    x, w = srcs[:2]
    bias = srcs[2] if len(srcs) == 3 else None
    p = node.params
    if out.dtype != np.float32 or x.dtype != np.float32 or w.dtype != np.float32:
        return None
    if bias is not None and (bias.dtype != np.float32 or bias.strides != (4,)):
        return None
    if not _one_row(p, x.shape, w.shape) or out.shape[2] != 1:
        return None
    if not w.flags.c_contiguous or not out.flags.c_contiguous:
        return None
    b, cin, _, length = x.shape
    cout, _, _, k = w.shape
    lout = out.shape[3]
    xs = estrides(x)
    direct = conv1d_direct(k, p["strides"][1], p["pads"][1][0], length, lout, xs[1], xs[3])
    return [cmd("conv1d", out, [x, w, bias], [1, b, cout, lout], [0, cout * lout, lout, 1], [[0, xs[0], xs[1], xs[3]]],
                ip=(p["strides"][1], p["pads"][1][0], p["dilations"][1], cin, k, length, conv1d_rows(lout), direct),
                scratch=conv1d_scratch(b, cin, k, lout, cout, direct))]
