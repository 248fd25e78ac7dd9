"""Convolution, pooling, normalization and Resize."""
from __future__ import annotations

import numpy as np

from flare.core.graph import WEIGHT

from ..errors import OnnxError
from ..values import Val
from .base import (F32, _as_2d, _identity, _axis, _channel_vec, _full, _need, _norm_tail, _pairs, _reduce_chain,
    _spatial_pads, _zero_upsample, cval, fold, lowers)


@lowers("Conv")
def _conv(tr, node, ins, attrs):
    x, w = _need(ins[0], "X"), _need(ins[1], "W")
    nd = len(x.shape) - 2
    kernel = list(w.shape[2:])
    strides = list(attrs.get("strides", [1] * nd))
    dil = list(attrs.get("dilations", [1] * nd))
    pads = _spatial_pads(attrs, x.shape[2:], kernel, strides, dil)
    t = _unpadded(tr, x, nd, pads)
    if t is None:
        t = _as_2d(tr, x)
    tw = _kernel_2d(tr, w) if nd == 1 else tr.t(w)
    pp = [[0, 0], [pads[0], pads[1]]] if nd == 1 else [[pads[0], pads[2]], [pads[1], pads[3]]]
    srcs = [t, tw]
    if len(ins) > 2 and ins[2] is not None:  # the bias as conv2d's third source (added as it writes)
        srcs.append(tr.t(_need(ins[2], "B")))
    out = tr.op("conv2d", *srcs, strides=_pairs(strides, nd, 1), dilations=_pairs(dil, nd, 1), pads=pp,
                groups=int(attrs.get("group", 1)))
    shape = tuple(out.shape) if nd == 2 else (out.shape[0], out.shape[1], out.shape[3])
    return [tr.val(out, shape, F32)]


def _kernel_2d(tr, w: Val):
    """A 1-D kernel [O, I, K] as the [O, I, 1, K] conv2d takes: for a kernel of the file, a
    constant of that shape made once per runner (a traced call makes no reshape node for each
    of the model's convolutions: Piper walks ~95 per new sentence), else a reshape."""
    if not w.fixed or w.const is None or not w.name:
        return tr.op("reshape", tr.t(w), shape=[w.shape[0], w.shape[1], 1, w.shape[2]])
    key = ("conv_kernel_2d", w.name)
    hit = tr.runner.derived.get(key)
    if hit is None or hit[0] is not w.const:  # the file's value (or its fold, made once per runner)
        hit = tr.runner.derived[key] = (w.const, np.asarray(w.const).reshape(w.shape[0], w.shape[1], 1, w.shape[2]))
    k4 = hit[1]
    # named after the file's value: a weight by name, like the file's own (no digest of its bytes)
    return tr.t(Val(f"{w.name}#conv2d-kernel", k4.shape, k4.dtype, const=k4, fixed=True))


def _unpadded(tr, x: Val, nd: int, pads: list[int]):
    """x's source as [N, C, H, W] when x is a zero constant padding of its spatial axes only
    (VITS's FFN pads before each convolution), `pads` grown by that padding in place: the
    convolution pads as it reads (a zero pad is the same arithmetic), and the padding is not run
    when nothing else reads it (the runner keeps only what a segment's outputs read). The Pad
    lowering made it a `pad` op, or concatenations with zero pieces (`shapes._pad_by_concat`).
    None otherwise."""
    t = x.tensor
    if t is None or len(t.shape) != nd + 2:
        return None
    grown = [0] * (2 * nd)  # begin of each spatial axis, then end, as ONNX orders conv pads
    if t.op == "pad":
        if t.params.get("mode", "constant") != "constant" or float(t.params.get("value", 0.0)) != 0.0:
            return None
        pairs = [list(p) for p in t.params["pads"]]
        if any(lo or hi for lo, hi in pairs[:2]) or any(v < 0 for p in pairs for v in p):
            return None
        for i in range(nd):
            grown[i], grown[i + nd] = pairs[2 + i]
        t = t.srcs[0]
    else:
        while t.op == "concat" and t.params["axis"] >= 2:
            piece = next((s for s in t.srcs if s.op is None and s.role == WEIGHT and s.data is not None
                          and not np.any(np.asarray(s.data))), None)
            if piece is None:
                break
            axis = t.params["axis"] - 2
            if piece is t.srcs[0]:
                grown[axis] += piece.shape[axis + 2]
                t = t.srcs[1]
            else:
                grown[axis + nd] += piece.shape[axis + 2]
                t = t.srcs[0]
        if t is x.tensor:
            return None
    for i in range(2 * nd):
        pads[i] += grown[i]
    if nd == 1:
        return tr.op("reshape", t, shape=[t.shape[0], t.shape[1], 1, t.shape[2]])
    return t


@lowers("MaxPool", "AveragePool")
def _pool(tr, node, ins, attrs):
    x = _need(ins[0], "X")
    nd = len(x.shape) - 2
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides", [1] * nd))
    dil = list(attrs.get("dilations", [1] * nd))
    pads = _spatial_pads(attrs, x.shape[2:], kernel, strides, dil)
    if node.op_type == "MaxPool" and len(node.output) > 1 and node.output[1]:
        if nd != 2:
            raise OnnxError("MaxPool's Indices output is supported for 2-D pooling")
        return _max_pool_with_indices(tr, x, kernel, strides, dil, pads, attrs)
    if nd == 3:
        return [_pool3d(tr, node.op_type, x, kernel, strides, dil, pads, attrs)]
    pp = [[0, 0], [pads[0], pads[1]]] if nd == 1 else [[pads[0], pads[2]], [pads[1], pads[3]]]
    params = dict(kernel=_pairs(kernel, nd, 1), strides=_pairs(strides, nd, 1), dilations=_pairs(dil, nd, 1),
                  pads=pp, ceil_mode=bool(attrs.get("ceil_mode", 0)))
    if node.op_type == "AveragePool":
        params["count_include_pad"] = bool(attrs.get("count_include_pad", 0))
    out = tr.op("max_pool2d" if node.op_type == "MaxPool" else "avg_pool2d", _as_2d(tr, x), **params)
    shape = tuple(out.shape) if nd == 2 else (out.shape[0], out.shape[1], out.shape[3])
    return [tr.val(out, shape, F32)]


LOWEST = float(np.finfo(np.float32).min)  # the padding of a max pool: never the maximum of a window


def _max_pool_with_indices(tr, x, kernel, strides, dil, pads, attrs):
    """2-D MaxPool with its Indices output: every window gathered from the (lowest-value padded)
    input by a constant index, its first maximum taken, and that cell's flat position in the
    unpadded [N, C, H, W] input (row-major, or column-major with storage_order=1) looked up."""
    from flare.core.ops.spatial import out_size

    n, c, h, w = x.shape
    ceil = bool(attrs.get("ceil_mode", 0))
    ho = out_size(h, kernel[0], strides[0], dil[0], pads[0], pads[2], ceil)
    wo = out_size(w, kernel[1], strides[1], dil[1], pads[1], pads[3], ceil)
    rows = np.arange(ho)[:, None, None, None] * strides[0] + np.arange(kernel[0])[None, None, :, None] * dil[0]
    cols = np.arange(wo)[None, :, None, None] * strides[1] + np.arange(kernel[1])[None, None, None, :] * dil[1]
    rows, cols = np.broadcast_arrays(rows, cols)  # [Ho, Wo, kh, kw], in padded coordinates
    hp, wp = max(h + pads[0] + pads[2], int(rows.max()) + 1), max(w + pads[1] + pads[3], int(cols.max()) + 1)
    k = kernel[0] * kernel[1]
    padded = tr.op("pad", tr.t(x), pads=[[0, 0], [0, 0], [pads[0], hp - h - pads[0]], [pads[1], wp - w - pads[1]]],
                   value=LOWEST)
    table = (rows * wp + cols).reshape(-1).astype(np.int64)
    windows = tr.op("reshape", tr.op("take", tr.op("reshape", padded, shape=[n * c, hp * wp]), tr.t(cval(table)),
                                     axis=1), shape=[n * c, ho * wo, k])
    best = tr.op("arg_max", windows, axis=2, keepdims=True)  # [N*C, Ho*Wo, 1], first maximum
    values = tr.op("take_along_axis", windows, best, axis=2)
    y, xx = rows - pads[0], cols - pads[1]
    where = (xx * h + y) if attrs.get("storage_order", 0) else (y * w + xx)
    where = np.broadcast_to(where.reshape(1, ho * wo, k), (n * c, ho * wo, k)).astype(np.int64)
    where = where + (np.arange(n * c, dtype=np.int64) * h * w)[:, None, None]
    index = tr.op("take_along_axis", tr.t(cval(np.ascontiguousarray(where))), best, axis=2)
    shape = (n, c, ho, wo)
    return [tr.val(values, shape, F32), tr.val(index, shape, np.dtype(np.int64))]


def _pool3d(tr, op_type, x, kernel, strides, dil, pads, attrs):
    """3-D max/average pooling as two 2-D pools: (H, W) for every depth, then the depth axis.
    Both are separable: a max of maxes, and an average whose divisor (valid cells, or the
    window with count_include_pad) is the product of the per-axis ones, ceil_mode included."""
    n, c, d, h, w = x.shape
    op = "max_pool2d" if op_type == "MaxPool" else "avg_pool2d"
    common = dict(ceil_mode=bool(attrs.get("ceil_mode", 0)))
    if op_type == "AveragePool":
        common["count_include_pad"] = bool(attrs.get("count_include_pad", 0))
    plane = tr.op(op, tr.op("reshape", tr.t(x), shape=[n, c * d, h, w]), kernel=kernel[1:], strides=strides[1:],
                  dilations=dil[1:], pads=[[pads[1], pads[4]], [pads[2], pads[5]]], **common)
    ho, wo = plane.shape[2:]
    depth = tr.op(op, tr.op("reshape", plane, shape=[n * c, 1, d, ho * wo]), kernel=[kernel[0], 1],
                  strides=[strides[0], 1], dilations=[dil[0], 1], pads=[[pads[0], pads[3]], [0, 0]], **common)
    return tr.val(depth, (n, c, depth.shape[2], ho, wo), F32)


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
    n, c = x.shape[0], x.shape[1]
    rest = int(np.prod(x.shape[2:], dtype=np.int64))
    t = tr.op("reshape", tr.t(x), shape=[n, c, rest])  # any rank (wide ones too) as [N, C, rest]
    if attrs.get("training_mode", 0):
        return _batch_norm_training(tr, x, t, ins[1:5], eps, float(attrs.get("momentum", 0.9)))
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


def _batch_norm_training(tr, x, t, params, eps, momentum):
    """training_mode=1: normalized by the batch's own mean and (population) variance per channel;
    also the running mean and variance, momentum-blended with the batch's."""
    scale, bias, mean, var = params
    c = x.shape[1]

    def channel_mean(v):
        return tr.op("mean", tr.op("mean", v, axis=2, keepdims=True), axis=0, keepdims=True)  # [1, C, 1]

    m = channel_mean(t)
    centered = tr.op("sub", t, m)
    v = channel_mean(tr.op("mul", centered, centered))
    inv = tr.op("reciprocal", tr.op("sqrt", tr.op("scale", v, scale=1.0, bias=eps)))
    y = tr.op("add", tr.op("mul", tr.op("mul", centered, inv), _channel_vec(tr, scale, 3)), _channel_vec(tr, bias, 3))

    def blend(running, batch):
        flat = tr.op("reshape", batch, shape=[c])
        return tr.val(tr.op("add", tr.op("scale", tr.t(running), scale=momentum),
                            tr.op("scale", flat, scale=1.0 - momentum)), (c,), F32)

    return [tr.val(y, x.shape, F32), blend(mean, m), blend(var, v)]


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
    if nd == 3:  # sum of |x|^p by the separable 3-D average pool (padding counted: zeros), then the root
        powed = tr.val(tr.op("pow", tr.op("abs", tr.t(x)), _full(tr, p, np.float32)), x.shape, F32)
        avg = _pool3d(tr, "AveragePool", powed, kernel, strides, dil, pads, {"ceil_mode": attrs.get("ceil_mode", 0),
                                                                      "count_include_pad": 1})
        total = tr.op("scale", tr.t(avg), scale=float(np.prod(kernel)))
        return [tr.val(tr.op("pow", total, _full(tr, 1.0 / p, np.float32)), avg.shape, F32)]
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
            # a negative total (output_shape past the natural size) pads the output: the standard's split
            total = strides[i] * (in_hw[i] - 1) + out_pad[i] + (kernel[i] - 1) * dil[i] + 1 - want[i]
            if auto == "SAME_UPPER":
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


@lowers("LRN")
def _lrn(tr, node, ins, attrs):
    """x / (bias + alpha / size * sum of x^2 over the channel window) ** beta: the window sum as
    `size` shifted slices of the channel-padded squares."""
    x = _need(ins[0], "X")
    if not 3 <= len(x.shape) <= 4:
        raise OnnxError(f"LRN of a rank-{len(x.shape)} input (3 and 4 are supported)")
    size = int(attrs["size"])
    alpha, beta, bias = float(attrs.get("alpha", 1e-4)), float(attrs.get("beta", 0.75)), float(attrs.get("bias", 1.0))
    t = tr.t(x)
    channels = x.shape[1]
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    pads = [[0, 0] for _ in x.shape]
    pads[1] = [before, after]
    sq = tr.op("pad", tr.op("mul", t, t), pads=pads)
    total = None
    for k in range(size):
        part = tr.op("slice", sq, axis=1, start=k, stop=k + channels)
        total = part if total is None else tr.op("add", total, part)
    denom = tr.op("pow", tr.op("scale", total, scale=alpha / size, bias=bias), _full(tr, beta, np.float32))
    return [tr.val(tr.op("div", t, denom), x.shape, F32)]


@lowers("GridSample")
def _grid_sample(tr, node, ins, attrs):
    x, grid = _need(ins[0], "X"), _need(ins[1], "grid")
    if len(x.shape) != 4:
        raise OnnxError(f"GridSample of a rank-{len(x.shape)} input (2-D, rank 4, is supported)")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(attrs.get("mode", "linear"), attrs.get("mode", "linear"))
    out = tr.op("grid_sample", tr.t(x), tr.t(grid), mode=mode, padding_mode=attrs.get("padding_mode", "zeros"),
                align_corners=bool(attrs.get("align_corners", 0)))
    return [tr.val(out, (x.shape[0], x.shape[1], grid.shape[1], grid.shape[2]), F32)]


@lowers("Upsample")
def _upsample(tr, node, ins, attrs):
    """Upsample (opsets 7-9), like Resize: one constant matrix per scaled axis, made by onnx's
    reference Upsample on an identity."""
    from onnx import helper

    x = _need(ins[0], "X")
    scales = [float(s) for s in (attrs["scales"] if "scales" in attrs else np.asarray(tr.c(ins[1])).reshape(-1))]
    if len(scales) != len(x.shape):
        raise OnnxError(f"{len(scales)} scales for a rank-{len(x.shape)} input")
    mode = attrs.get("mode", "nearest")
    t = tr.t(x)
    rank = len(x.shape)
    shape = list(x.shape)
    for a, s in enumerate(scales):
        if s == 1.0:
            continue
        n = x.shape[a]
        if "scales" in attrs:
            probe = helper.make_node("Upsample", ["X"], ["Y"], mode=mode, scales=[1.0, s])
            eye = fold(tr, probe, [cval(np.eye(n, dtype=np.float32))])[0].const
        else:
            probe = helper.make_node("Upsample", ["X", "scales"], ["Y"], mode=mode)
            eye = fold(tr, probe, [cval(np.eye(n, dtype=np.float32)), cval(np.array([1.0, s], np.float32))])[0].const
        mat = np.ascontiguousarray(eye.T.astype(np.float32))  # [m, n]
        perm = list(range(rank))
        perm[a], perm[-1] = perm[-1], perm[a]
        moved = tr.op("permute", t, axes=perm) if a != rank - 1 else t
        moved = tr.op("matmul", moved, tr.t(cval(mat)), transpose_b=True)
        t = tr.op("contiguous", tr.op("permute", moved, axes=perm)) if a != rank - 1 else moved
        shape[a] = mat.shape[0]
    if t is tr.t(x):
        t = tr.op("contiguous", t)
    return [tr.val(t, tuple(shape), F32)]


MAX_STFT_MATRIX = 1 << 24  # elements of STFT's constant matrix (signal length x outputs)


@lowers("OptionalGetElement")
def _optional_get_element(tr, node, ins, attrs):
    """Of a plain tensor (optional and sequence values are not supported): the tensor itself."""
    return _identity(tr, node, ins, attrs)


@lowers("STFT")
def _stft(tr, node, ins, attrs):
    """STFT is linear in the signal once frame step, window and frame length are known: one
    constant matrix, made by onnx's reference STFT on unit impulses (as DFT is lowered),
    and a matmul per call. Real signals [B, L, 1]."""
    from onnx import helper

    x = _need(ins[0], "signal")
    if len(x.shape) != 3 or x.shape[2] != 1:
        raise OnnxError(f"STFT of a signal {x.shape} (real signals [batch, length, 1] are supported)")
    b, length = x.shape[0], x.shape[1]
    names = ["signal"] + [f"in{i}" if i < len(ins) and ins[i] is not None else "" for i in range(1, 4)]
    probe = helper.make_node("STFT", names, ["y"], **attrs)
    feeds = [cval(np.eye(length, dtype=np.float32).reshape(length, length, 1))]
    feeds += [None if i >= len(ins) or ins[i] is None else cval(np.asarray(tr.c(ins[i]))) for i in range(1, 4)]
    impulses = fold(tr, probe, feeds)[0].const  # [L, frames, bins, 2]
    out_shape = (b,) + tuple(impulses.shape[1:])
    width = int(np.prod(impulses.shape[1:], dtype=np.int64))
    if length * width > MAX_STFT_MATRIX:
        raise OnnxError(f"STFT's matrix would hold {length * width} elements (at most {MAX_STFT_MATRIX})")
    mat = np.ascontiguousarray(impulses.reshape(length, width).T.astype(np.float32))  # [width, L]
    flat = tr.op("matmul", tr.op("reshape", tr.t(x), shape=[b, length]), tr.t(cval(mat)), transpose_b=True)
    return [tr.val(flat, out_shape, F32)]
