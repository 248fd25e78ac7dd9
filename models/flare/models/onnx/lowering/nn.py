"""Convolution, pooling, normalization and Resize."""
from __future__ import annotations

import numpy as np

from ..errors import OnnxError
from ..values import Val
from .base import (F32, _as_2d, _axis, _channel_vec, _full, _need, _norm_tail, _pairs, _reduce_chain,
    _spatial_pads, _zero_upsample, cval, fold, lowers)


@lowers("Conv")
def _conv(tr, node, ins, attrs):
    x, w = _need(ins[0], "X"), _need(ins[1], "W")
    nd = len(x.shape) - 2
    kernel = list(w.shape[2:])
    strides = list(attrs.get("strides", [1] * nd))
    dil = list(attrs.get("dilations", [1] * nd))
    pads = _spatial_pads(attrs, x.shape[2:], kernel, strides, dil)
    t = _as_2d(tr, x)
    tw = tr.t(w)
    if nd == 1:
        tw = tr.op("reshape", tw, shape=[w.shape[0], w.shape[1], 1, w.shape[2]])
    pp = [[0, 0], [pads[0], pads[1]]] if nd == 1 else [[pads[0], pads[2]], [pads[1], pads[3]]]
    srcs = [t, tw]
    if len(ins) > 2 and ins[2] is not None:  # the bias as conv2d's third source (added as it writes)
        srcs.append(tr.t(_need(ins[2], "B")))
    out = tr.op("conv2d", *srcs, strides=_pairs(strides, nd, 1), dilations=_pairs(dil, nd, 1), pads=pp,
                groups=int(attrs.get("group", 1)))
    shape = tuple(out.shape) if nd == 2 else (out.shape[0], out.shape[1], out.shape[3])
    return [tr.val(out, shape, F32)]


@lowers("MaxPool", "AveragePool")
def _pool(tr, node, ins, attrs):
    x = _need(ins[0], "X")
    if node.op_type == "MaxPool" and len(node.output) > 1 and node.output[1]:
        raise OnnxError("MaxPool's Indices output is not supported")
    nd = len(x.shape) - 2
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides", [1] * nd))
    dil = list(attrs.get("dilations", [1] * nd))
    pads = _spatial_pads(attrs, x.shape[2:], kernel, strides, dil)
    pp = [[0, 0], [pads[0], pads[1]]] if nd == 1 else [[pads[0], pads[2]], [pads[1], pads[3]]]
    params = dict(kernel=_pairs(kernel, nd, 1), strides=_pairs(strides, nd, 1), dilations=_pairs(dil, nd, 1),
                  pads=pp, ceil_mode=bool(attrs.get("ceil_mode", 0)))
    if node.op_type == "AveragePool":
        params["count_include_pad"] = bool(attrs.get("count_include_pad", 0))
    out = tr.op("max_pool2d" if node.op_type == "MaxPool" else "avg_pool2d", _as_2d(tr, x), **params)
    shape = tuple(out.shape) if nd == 2 else (out.shape[0], out.shape[1], out.shape[3])
    return [tr.val(out, shape, F32)]


@lowers("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(tr, node, ins, attrs):
    x = _need(ins[0], "X")
    op = "mean" if node.op_type == "GlobalAveragePool" else "max"
    t, shape = _reduce_chain(tr, tr.t(x), x.shape, list(range(2, len(x.shape))), True, op)
    return [tr.val(t, shape, F32)]


@lowers("BatchNormalization")
def _batch_norm(tr, node, ins, attrs):
    x, scale, bias, mean, var = ins[:5]
    _need(x, "X")
    eps = float(attrs.get("epsilon", 1e-5))
    if attrs.get("training_mode", 0):
        raise OnnxError("training_mode=1 is not supported (inference only)")
    n, c = x.shape[0], x.shape[1]
    rest = int(np.prod(x.shape[2:], dtype=np.int64))
    t = tr.op("reshape", tr.t(x), shape=[n, c, rest])  # any rank (wide ones too) as [N, C, rest]
    if all(v.is_const and not v.runtime for v in (scale, bias, mean, var)):
        a = (scale.const.astype(np.float64) / np.sqrt(var.const.astype(np.float64) + eps))
        b = bias.const.astype(np.float64) - mean.const.astype(np.float64) * a
        out = tr.op("add", tr.op("mul", t, tr.t(cval(a.astype(np.float32).reshape(c, 1)))),
                    tr.t(cval(b.astype(np.float32).reshape(c, 1))))
    else:
        inv = tr.op("reciprocal", tr.op("sqrt", tr.op("scale", _channel_vec(tr, var, 3), scale=1.0, bias=eps)))
        a = tr.op("mul", inv, _channel_vec(tr, scale, 3))
        out = tr.op("add", tr.op("mul", tr.op("sub", t, _channel_vec(tr, mean, 3)), a), _channel_vec(tr, bias, 3))
    return [tr.val(out, x.shape, F32)]


@lowers("LayerNormalization", "RMSNormalization")
def _layer_norm(tr, node, ins, attrs):
    x = _need(ins[0], "X")
    rank = len(x.shape)
    axis = _axis(attrs.get("axis", -1), rank)
    inner = int(np.prod(x.shape[axis:], dtype=np.int64))
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    eps = float(attrs.get("epsilon", 1e-5))
    op = "layer_norm" if node.op_type == "LayerNormalization" else "rms_norm"
    out = _norm_tail(tr, x, [outer, inner], op, eps, list(x.shape) or [1])
    out = tr.op("mul", out, tr.t(ins[1]))
    if len(ins) > 2 and ins[2] is not None:
        out = tr.op("add", out, tr.t(ins[2]))
    result = [tr.val(out, x.shape, F32)]
    if len(node.output) > 1 and any(node.output[1:]):  # the statistics, over the normalized axes
        stat_shape = tuple(x.shape[:axis]) + (1,) * (rank - axis)
        flat = tr.op("reshape", tr.t(x), shape=[outer, inner])
        mean = tr.op("mean", flat, axis=-1, keepdims=True)
        var = tr.op("mean", tr.op("sqr", tr.op("sub", flat, mean)), axis=-1, keepdims=True)
        inv = tr.op("reciprocal", tr.op("sqrt", tr.op("scale", var, scale=1.0, bias=eps)))
        result += [tr.val(mean, stat_shape, F32), tr.val(inv, stat_shape, F32)]
    return result


@lowers("InstanceNormalization")
def _instance_norm(tr, node, ins, attrs):
    x = _need(ins[0], "input")
    rank = len(x.shape)
    n, c = x.shape[:2]
    inner = int(np.prod(x.shape[2:], dtype=np.int64))
    out = _norm_tail(tr, x, [n, c, inner], "layer_norm", float(attrs.get("epsilon", 1e-5)), list(x.shape))
    out = tr.op("add", tr.op("mul", out, _channel_vec(tr, ins[1], rank)), _channel_vec(tr, ins[2], rank))
    return [tr.val(out, x.shape, F32)]


@lowers("LpPool", "GlobalLpPool")
def _lp_pool(tr, node, ins, attrs):
    x = _need(ins[0], "X")
    p = float(attrs.get("p", 2))
    nd = len(x.shape) - 2
    if node.op_type == "GlobalLpPool":
        t = tr.op("pow", tr.op("abs", tr.t(x)), _full(tr, p, np.float32))
        t, shape = _reduce_chain(tr, t, x.shape, list(range(2, len(x.shape))), True, "sum")
        return [tr.val(tr.op("pow", t, _full(tr, 1.0 / p, np.float32)), shape, F32)]
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides", [1] * nd))
    dil = list(attrs.get("dilations", [1] * nd))
    pads = _spatial_pads(attrs, x.shape[2:], kernel, strides, dil)
    pp = [[0, 0], [pads[0], pads[1]]] if nd == 1 else [[pads[0], pads[2]], [pads[1], pads[3]]]
    powed = tr.op("pow", tr.op("abs", _as_2d(tr, x)), _full(tr, p, np.float32))
    avg = tr.op("avg_pool2d", powed, kernel=_pairs(kernel, nd, 1), strides=_pairs(strides, nd, 1),
                dilations=_pairs(dil, nd, 1), pads=pp, ceil_mode=bool(attrs.get("ceil_mode", 0)),
                count_include_pad=True)
    total = tr.op("scale", avg, scale=float(np.prod(kernel)))
    out = tr.op("pow", total, _full(tr, 1.0 / p, np.float32))
    shape = tuple(out.shape) if nd == 2 else (out.shape[0], out.shape[1], out.shape[3])
    return [tr.val(out, shape, F32)]


@lowers("Resize")
def _resize(tr, node, ins, attrs):
    """Resize as one constant matrix per resized axis (every ONNX mode is separable and linear:
    nearest, linear, cubic, antialias), each matrix made by onnx's reference Resize on an
    identity, plus the constant extrapolation term of tf_crop_and_resize."""
    from onnx import helper

    x = _need(ins[0], "X")
    rank = len(x.shape)

    def given(i):
        if len(ins) > i and ins[i] is not None and int(np.prod(ins[i].shape, dtype=np.int64)) > 0:
            return np.asarray(tr.c(ins[i]))
        return None

    roi, scales, sizes = given(1), given(2), given(3)
    axes = [_axis(a, rank) for a in attrs.get("axes", range(rank))]
    full = fold(tr, node, [cval(np.zeros(x.shape, np.float32))] + [None if v is None else cval(tr.c(v)) for v in ins[1:]])
    out_shape = full[0].shape
    keep = {k: v for k, v in attrs.items() if k not in ("axes", "keep_aspect_ratio_policy")}
    t = tr.t(x)
    shape = list(x.shape)
    for j, a in enumerate(axes):
        n, m = x.shape[a], out_shape[a]
        if scales is not None:
            s = float(scales[j])
        elif attrs.get("keep_aspect_ratio_policy", "stretch") != "stretch":
            s = float(m) / n
            ratios = [float(sizes[k]) / x.shape[ax] for k, ax in enumerate(axes)]
            s = min(ratios) if attrs["keep_aspect_ratio_policy"] == "not_larger" else max(ratios)
        else:
            s = None
        roi2 = None if roi is None else np.array([0, roi[j], 1, roi[j + len(axes)]], np.float32)
        names = ["X", "roi" if roi2 is not None else "", "scales" if s is not None else "", "" if s is not None else "sizes"]
        probe = helper.make_node("Resize", names, ["Y"], **keep)
        feeds = [None if roi2 is None else cval(roi2),
                 None if s is None else cval(np.array([1.0, s], np.float32)),
                 None if s is not None else cval(np.array([n, m], np.int64))]
        eye = fold(tr, probe, [cval(np.eye(n, dtype=np.float32))] + feeds)[0].const
        base = fold(tr, probe, [cval(np.zeros((1, n), np.float32))] + feeds)[0].const
        if eye.shape[1] != m:
            raise OnnxError(f"resize of axis {a}: {eye.shape[1]} outputs where the whole op gives {m}")
        mat = (eye.astype(np.float64) - base.astype(np.float64)).T.astype(np.float32)  # [m, n]
        if m == n and np.array_equal(mat, np.eye(n, dtype=np.float32)) and not base.any():
            continue
        perm = list(range(rank))
        perm[a], perm[-1] = perm[-1], perm[a]
        moved = tr.op("permute", t, axes=perm) if a != rank - 1 else t
        moved = tr.op("matmul", moved, tr.t(cval(mat)), transpose_b=True)
        if base.any():
            moved = tr.op("add", moved, tr.t(cval(base.reshape(-1).astype(np.float32))))
        t = tr.op("permute", moved, axes=perm) if a != rank - 1 else moved
        shape[a] = m
    if t is tr.t(x):
        t = tr.op("contiguous", t)
    return [tr.val(tr.op("contiguous", t) if t.view_of is not None else t, tuple(shape), F32)]


@lowers("ConvTranspose")
def _conv_transpose(tr, node, ins, attrs):
    """The transposed convolution as a plain one: zeros between the input's elements (stride),
    full padding less the given pads, and the kernel flipped with in/out channels swapped per group."""
    x, w = _need(ins[0], "X"), _need(ins[1], "W")
    nd = len(x.shape) - 2
    if nd not in (1, 2):
        raise OnnxError(f"{nd}-D ConvTranspose (1-D and 2-D are supported)")
    g = int(attrs.get("group", 1))
    kernel = list(w.shape[2:])
    strides = list(attrs.get("strides", [1] * nd))
    dil = list(attrs.get("dilations", [1] * nd))
    out_pad = list(attrs.get("output_padding", [0] * nd))
    in_hw = list(x.shape[2:])
    pads = list(attrs.get("pads", [0] * (2 * nd)))
    auto = attrs.get("auto_pad", "NOTSET")
    if "output_shape" in attrs or auto in ("SAME_UPPER", "SAME_LOWER"):
        want = list(attrs["output_shape"])[-nd:] if "output_shape" in attrs else [i * s for i, s in zip(in_hw, strides)]
        for i in range(nd):
            total = strides[i] * (in_hw[i] - 1) + out_pad[i] + (kernel[i] - 1) * dil[i] + 1 - want[i]
            total = max(total, 0)
            if auto == "SAME_UPPER" or (auto != "SAME_LOWER" and "output_shape" in attrs):
                pads[i], pads[i + nd] = total // 2, total - total // 2
            else:
                pads[i], pads[i + nd] = total - total // 2, total // 2
    elif auto == "VALID":
        pads = [0] * (2 * nd)
    cin, cout_g = w.shape[0], w.shape[1]
    if nd == 1 and g == 1 and dil == [1] and strides[0] > 1:
        return _conv_transpose_1d_phases(tr, node, ins, strides[0], pads[0], pads[1], out_pad[0])
    wk = np.asarray(tr.c(w), np.float32)  # a kernel given as an input is read back: a host step
    wk = wk.reshape(g, cin // g, cout_g, *kernel).swapaxes(1, 2).reshape(g * cout_g, cin // g, *kernel)
    wk = np.ascontiguousarray(np.flip(wk, axis=tuple(range(2, 2 + nd))))
    if nd == 1:
        wk = wk.reshape(wk.shape[0], wk.shape[1], 1, wk.shape[2])
    t = _as_2d(tr, x)
    axes = [3] if nd == 1 else [2, 3]
    sizes = []
    for i, a in enumerate(axes):
        t, n = _zero_upsample(tr, t, a, in_hw[i], strides[i])
        sizes.append(n)
    conv_pads = []
    for i, a in enumerate(axes):
        full = dil[i] * (kernel[i] - 1)
        lo, hi = full - pads[i], full - pads[i + nd] + out_pad[i]
        if lo < 0 or hi < 0:  # more padding than the kernel reaches: crop instead
            t = tr.op("slice", t, axis=a, start=max(0, -lo), stop=sizes[i] - max(0, -hi))
            sizes[i] -= max(0, -lo) + max(0, -hi)
            lo, hi = max(lo, 0), max(hi, 0)
        conv_pads.append([lo, hi])
    pp = [[0, 0], conv_pads[0]] if nd == 1 else conv_pads
    out = tr.op("conv2d", t, tr.t(cval(wk)), strides=[1, 1], dilations=_pairs(dil, nd, 1), pads=pp, groups=g)
    if len(ins) > 2 and ins[2] is not None:
        out = tr.op("add", out, tr.op("reshape", tr.t(ins[2]), shape=[ins[2].shape[0], 1, 1]))
    shape = tuple(out.shape) if nd == 2 else (out.shape[0], out.shape[1], out.shape[3])
    return [tr.val(out, shape, F32)]


def _conv_transpose_1d_phases(tr, node, ins, s, pad_lo, pad_hi, out_pad):
    """A strided 1-D ConvTranspose (one group, no dilation) as ONE plain convolution with s
    times the output channels, one block per output phase, then an interleave.

    Why: zero upsampling would make the convolution multiply (s - 1) zeros of every s inputs
    (7 of 8 in Piper's decoder, a third of its arithmetic). Output position q*s + r sums
    x[q - j] * w[j*s + r] over j < ceil(K/s), which is a convolution of x (left pad
    ceil(K/s) - 1) with the taps of phase r reversed: phase r's kernels are output channels
    r*Cout .. (r+1)*Cout - 1, and [B, s, Cout, Q] permuted to [B, Cout, Q, s] is the
    interleaved signal, cropped by the pads."""
    x, w = ins[0], ins[1]
    b, cin, length = x.shape
    cout, k = w.shape[1], w.shape[2]
    kp = -(-k // s)
    lout = s * (length - 1) + out_pad + k - pad_lo - pad_hi
    q = max(length + kp - 1, -(-(pad_lo + lout) // s))
    key = ("conv_transpose_phases", node.output[0], s)
    cache = tr.runner.derived if w.fixed else {}
    wp = cache.get(key)
    if wp is None:
        wk = np.zeros((cin, cout, kp * s), np.float32)
        wk[:, :, :k] = np.asarray(tr.c(w), np.float32)  # a kernel given as an input is read back: a host step
        wk = wk.reshape(cin, cout, kp, s)[:, :, ::-1, :]                  # [c, o, m, r], m = kp - 1 - j
        wp = np.ascontiguousarray(wk.transpose(3, 1, 0, 2)).reshape(s * cout, cin, 1, kp)
        cache[key] = wp
    wv = Val("", wp.shape, np.dtype(np.float32), const=wp, fixed=w.fixed)
    z = tr.op("conv2d", _as_2d(tr, x), tr.t(wv), strides=[1, 1], dilations=[1, 1], pads=[[0, 0], [kp - 1, q - length]],
              groups=1)                                                    # [B, s*Cout, 1, Q]
    z = tr.op("contiguous", tr.op("permute", tr.op("reshape", z, shape=[b, s, cout, q]), axes=[0, 2, 3, 1]))
    out = tr.op("slice", tr.op("reshape", z, shape=[b, cout, q * s]), axis=2, start=pad_lo, stop=pad_lo + lout)
    if len(ins) > 2 and ins[2] is not None:
        out = tr.op("add", out, tr.op("reshape", tr.t(ins[2]), shape=[cout, 1]))
    else:
        out = tr.op("contiguous", out)
    return [tr.val(out, (b, cout, lout), F32)]


@lowers("DFT")
def _dft(tr, node, ins, attrs):
    """DFT as one constant real matrix on the flattened [n, re/im] signal: the op is linear, so the
    matrix is onnx's reference DFT applied to every unit impulse (onesided, inverse and
    dft_length included exactly as the standard defines them)."""
    from onnx import helper

    x = _need(ins[0], "input")
    rank = len(x.shape)
    if tr.opset >= 20:
        axis = int(np.asarray(tr.c(ins[2])).reshape(-1)[0]) if len(ins) > 2 and ins[2] is not None else -2
    else:
        axis = int(attrs.get("axis", 1))
    axis = _axis(axis, rank)
    if axis == rank - 1:
        raise OnnxError("DFT over the last (real/imaginary) axis")
    n, c = x.shape[axis], x.shape[-1]
    length = ins[1] if len(ins) > 1 and ins[1] is not None and ins[1].shape != (0,) else None
    basis = np.eye(n * c, dtype=np.float32).reshape(n * c, n, c)
    keep = {k: v for k, v in attrs.items() if k in ("inverse", "onesided")}
    feeds = [cval(basis), None if length is None else cval(np.asarray(tr.c(length)))]
    if tr.opset >= 20:
        probe = helper.make_node("DFT", ["x", "len" if length is not None else "", "axis"], ["y"], **keep)
        feeds.append(cval(np.array(1, np.int64)))
    else:
        probe = helper.make_node("DFT", ["x", "len" if length is not None else ""], ["y"], axis=1, **keep)
    out = np.asarray(fold(tr, probe, feeds)[0].const, np.float32)     # [n*c, n_out, 2 (or 1: a real result)]
    n_out, parts = out.shape[1], out.shape[2]
    mat = out.reshape(n * c, n_out * parts)
    perm = [i for i in range(rank) if i not in (axis, rank - 1)] + [axis, rank - 1]
    moved_shape = [x.shape[i] for i in perm[:-2]]
    rows = int(np.prod(moved_shape, dtype=np.int64))
    t = tr.op("reshape", tr.op("contiguous", tr.op("permute", tr.t(x), axes=perm)), shape=[rows, n * c])
    t = tr.op("matmul", t, tr.t(cval(mat)))
    t = tr.op("reshape", t, shape=moved_shape + [n_out, parts])
    inverse = [perm.index(i) for i in range(rank)]
    shape = list(x.shape)
    shape[axis], shape[-1] = n_out, parts
    return [tr.val(tr.op("contiguous", tr.op("permute", t, axes=inverse)), tuple(shape), F32)]
