"""Shape and layout ONNX ops: Shape, Reshape family, Transpose, Concat, Slice, Split, gathers and
scatters, Expand, Tile, Pad, Trilu, OneHot (wide values go through [before, axis, after] views)."""
from __future__ import annotations

import numpy as np

from ..errors import OnnxError
from ..values import BOOL, MAX_RANK, flare_shape, is_wide
from .base import (F32, I32, _axis, _full, _identity, _indices, _ints, _reshape_to, _slice_axis, cval, lowers,
    merged_broadcast, merged_permutation)


# -- shapes and layout ----------------------------------------------------------------
@lowers("Shape")
def _shape(tr, node, ins, attrs):
    shape = list(ins[0].shape)
    start, end = attrs.get("start", 0), attrs.get("end", None)
    return [cval(np.array(shape[slice(start, end)], dtype=np.int64))]


@lowers("Size")
def _size(tr, node, ins, attrs):
    return [cval(np.array(int(np.prod(ins[0].shape, dtype=np.int64)), dtype=np.int64))]


@lowers("EyeLike")
def _eyelike(tr, node, ins, attrs):
    from ..values import np_dtype_of

    dtype = np_dtype_of(attrs["dtype"], "EyeLike.dtype") if "dtype" in attrs else ins[0].dtype
    n, m = ins[0].shape
    return [cval(np.eye(n, m, k=int(attrs.get("k", 0)), dtype=dtype))]


@lowers("ConstantOfShape")
def _constant_of_shape(tr, node, ins, attrs):
    from onnx import numpy_helper

    shape = _ints(tr, ins[0])
    value = numpy_helper.to_array(attrs["value"]) if "value" in attrs else np.zeros(1, np.float32)
    return [cval(np.full(shape, value.reshape(-1)[0], dtype=value.dtype))]


@lowers("Range")
def _range(tr, node, ins, attrs):
    start, limit, delta = (np.asarray(tr.c(v)).reshape(()) for v in ins)
    return [cval(np.arange(start, limit, delta, dtype=ins[0].dtype))]


@lowers("Reshape")
def _reshape(tr, node, ins, attrs):
    x = ins[0]
    target = _ints(tr, ins[1]) if len(ins) > 1 else list(attrs["shape"])
    if not attrs.get("allowzero", 0):
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    if -1 in target:
        known = int(np.prod([d for d in target if d != -1], dtype=np.int64))
        total = int(np.prod(x.shape, dtype=np.int64))
        target[target.index(-1)] = total // known if known else 0
    return _reshape_to(tr, x, tuple(target))


@lowers("Flatten")
def _flatten(tr, node, ins, attrs):
    x = ins[0]
    axis = attrs.get("axis", 1)
    axis = axis % len(x.shape) if axis < 0 else axis
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    return _reshape_to(tr, x, (outer, int(np.prod(x.shape[axis:], dtype=np.int64))))


@lowers("Squeeze")
def _squeeze(tr, node, ins, attrs):
    x = ins[0]
    axes = _ints(tr, ins[1]) if len(ins) > 1 and ins[1] is not None else attrs.get("axes")
    rank = len(x.shape)
    axes = [i for i, d in enumerate(x.shape) if d == 1] if not axes else [_axis(a, rank) for a in axes]
    return _reshape_to(tr, x, tuple(d for i, d in enumerate(x.shape) if i not in axes))


@lowers("Unsqueeze")
def _unsqueeze(tr, node, ins, attrs):
    x = ins[0]
    axes = _ints(tr, ins[1]) if len(ins) > 1 and ins[1] is not None else list(attrs["axes"])
    rank = len(x.shape) + len(axes)
    axes = sorted(_axis(a, rank) for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return _reshape_to(tr, x, tuple(shape))


@lowers("Transpose")
def _transpose(tr, node, ins, attrs):
    x = ins[0]
    rank = len(x.shape)
    perm = list(attrs.get("perm", range(rank - 1, -1, -1)))
    if rank <= 1:
        return _identity(tr, node, ins, attrs)
    out_shape = tuple(x.shape[p] for p in perm)
    if is_wide(x.shape):
        src, merged_perm = merged_permutation(x.shape, perm)
        if len(src) > MAX_RANK:
            # no permute of that rank: gather the flat elements in the transposed order (a constant index)
            size = int(np.prod(x.shape, dtype=np.int64))
            order = np.arange(size, dtype=np.int64).reshape(x.shape).transpose(perm).reshape(-1)
            flat = tr.op("reshape", tr.t(x), shape=[size])
            return [tr.val(tr.op("take", flat, tr.t(cval(order)), axis=0), out_shape, x.dtype)]
        t = tr.op("reshape", tr.t(x), shape=list(src))
        return [tr.val(tr.op("contiguous", tr.op("permute", t, axes=merged_perm)), out_shape, x.dtype)]
    out = tr.op("permute", tr.t(x), axes=perm)
    return [tr.val(out, out_shape, x.dtype)]


@lowers("Concat")
def _concat(tr, node, ins, attrs):
    vals = [v for v in ins if v is not None and int(np.prod(v.shape, dtype=np.int64)) > 0]
    if not vals:
        vals = [ins[0]]
    axis = _axis(attrs["axis"], len(vals[0].shape))
    shape = list(vals[0].shape)
    if is_wide(tuple(shape)):  # rank > 4: every input as [before, axis, after], joined on the middle axis
        before = int(np.prod(shape[:axis], dtype=np.int64))
        after = int(np.prod(shape[axis + 1:], dtype=np.int64))
        parts = [tr.op("reshape", tr.t(v), shape=[before, v.shape[axis], after]) for v in vals]
        out = parts[0]
        for part in parts[1:]:
            out = tr.op("concat", out, part, axis=1)
        shape[axis] = sum(v.shape[axis] for v in vals)
        if len(parts) == 1:
            out = tr.op("contiguous", out)
        return [tr.val(out, tuple(shape), vals[0].dtype)]
    out = tr.t(vals[0])
    for v in vals[1:]:
        out = tr.op("concat", out, tr.t(v), axis=axis)
        shape[axis] += v.shape[axis]
    if len(vals) == 1:
        out = tr.op("contiguous", out)
    return [tr.val(out, tuple(shape), vals[0].dtype)]


@lowers("Slice")
def _slice(tr, node, ins, attrs):
    x = ins[0]
    rank = len(x.shape)
    if tr.opset < 10:
        starts, ends = list(attrs["starts"]), list(attrs["ends"])
        axes = list(attrs.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = _ints(tr, ins[1]), _ints(tr, ins[2])
        axes = _ints(tr, ins[3]) if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
        steps = _ints(tr, ins[4]) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    t = tr.t(x)
    shape = list(x.shape)
    big = 1 << 62
    lengths = {}
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = _axis(a, rank)
        lengths[a] = len(range(*slice(max(min(s, big), -big), max(min(e, big), -big), st).indices(shape[a])))
    if 0 in lengths.values():  # an empty result: a constant with no data (no Flare tensor has zero size)
        return [cval(np.zeros([lengths.get(i, d) for i, d in enumerate(shape)], dtype=x.dtype))]
    wide = is_wide(tuple(shape))
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = _axis(a, rank)
        s = max(min(s, big), -big)
        e = max(min(e, big), -big)
        if wide:  # rank > 4: slice the middle axis of [before, axis, after]
            before = int(np.prod(shape[:a], dtype=np.int64))
            after = int(np.prod(shape[a + 1:], dtype=np.int64))
            t = tr.op("reshape", t, shape=[before, shape[a], after])
            t, shape[a] = _slice_axis(tr, t, [before, shape[a], after], 1, s, e, st)
        else:
            t, shape[a] = _slice_axis(tr, t, shape, a, s, e, st)
    if t is tr.t(x):
        t = tr.op("contiguous", t)
    return [tr.val(t, tuple(shape), x.dtype)]


@lowers("Split")
def _split(tr, node, ins, attrs):
    x = ins[0]
    axis = _axis(attrs.get("axis", 0), len(x.shape))
    n_out = len(node.output)
    sizes = _ints(tr, ins[1]) if len(ins) > 1 and ins[1] is not None else attrs.get("split")
    if not sizes:
        dim = x.shape[axis]
        per = -(-dim // n_out) if tr.opset >= 18 else dim // n_out
        sizes = [min(per, dim - i * per) for i in range(n_out)]
    outs, at = [], 0
    for size in sizes:
        shape = list(x.shape)
        shape[axis] = size
        if size == 0:  # an empty piece: a constant with no data (no Flare tensor has zero size)
            outs.append(cval(np.zeros(shape, dtype=x.dtype)))
            continue
        t = tr.op("contiguous", tr.op("slice", tr.t(x), axis=axis, start=at, stop=at + size))
        outs.append(tr.val(t, tuple(shape), x.dtype))
        at += size
    return outs


@lowers("Gather")
def _gather(tr, node, ins, attrs):
    x, idx = ins
    axis = _axis(attrs.get("axis", 0), len(x.shape))
    out = tr.op("take", tr.t(x), _indices(tr, idx), axis=axis)
    shape = (*x.shape[:axis], *idx.shape, *x.shape[axis + 1:])
    return [tr.val(out, shape, x.dtype)]


@lowers("GatherElements")
def _gather_elements(tr, node, ins, attrs):
    x, idx = ins
    axis = _axis(attrs.get("axis", 0), len(x.shape))
    if is_wide(x.shape) or is_wide(idx.shape):  # rank > 4: both as [before, axis, after] when the rest agrees
        if x.shape[:axis] != idx.shape[:axis] or x.shape[axis + 1:] != idx.shape[axis + 1:]:
            raise OnnxError(f"GatherElements of rank {len(x.shape)}: data {x.shape} and indices {idx.shape} "
                            f"must agree off the axis")
        before = int(np.prod(x.shape[:axis], dtype=np.int64))
        after = int(np.prod(x.shape[axis + 1:], dtype=np.int64))
        tx = tr.op("reshape", tr.t(x), shape=[before, x.shape[axis], after])
        ti = tr.op("reshape", tr.t(idx), shape=[before, idx.shape[axis], after])
        return [tr.val(tr.op("take_along_axis", tx, ti, axis=1), idx.shape, x.dtype)]
    return [tr.val(tr.op("take_along_axis", tr.t(x), tr.t(idx), axis=axis), idx.shape, x.dtype)]


@lowers("Expand")
def _expand(tr, node, ins, attrs):
    x = ins[0]
    shape = tuple(np.broadcast_shapes(x.shape, tuple(_ints(tr, ins[1]))))
    t = tr.t(x)
    if len(shape) <= MAX_RANK:
        if len(x.shape) > MAX_RANK:
            raise OnnxError(f"expand of a rank-{len(x.shape)} value to rank {len(shape)}")
        return [tr.val(tr.op("expand", t, shape=list(shape) or [1]), shape, x.dtype)]
    src_m, out_m = merged_broadcast((1,) * (len(shape) - len(x.shape)) + tuple(x.shape), shape)
    if len(out_m) > MAX_RANK:
        raise OnnxError(f"expand {x.shape} -> {shape} needs rank {len(out_m)} even with axes merged")
    t = tr.op("reshape", t, shape=list(src_m))
    return [tr.val(tr.op("expand", t, shape=list(out_m)), shape, x.dtype)]


@lowers("Tile")
def _tile(tr, node, ins, attrs):
    x = ins[0]
    reps = _ints(tr, ins[1])
    out = tr.op("tile", tr.t(x), repeats=reps)
    return [tr.val(out, tuple(d * r for d, r in zip(x.shape, reps)), x.dtype)]


@lowers("Pad")
def _pad(tr, node, ins, attrs):
    x = ins[0]
    rank = len(x.shape)
    mode = attrs.get("mode", "constant")
    if tr.opset < 11:
        pads = list(attrs["pads"])
        value = float(attrs.get("value", 0.0))
        axes = list(range(rank))
    else:
        pads = _ints(tr, ins[1])
        value = 0.0
        if len(ins) > 2 and ins[2] is not None and ins[2].shape != (0,):
            value = float(np.asarray(tr.c(ins[2])).reshape(-1)[0])
        axes = _ints(tr, ins[3]) if len(ins) > 3 and ins[3] is not None else list(range(rank))
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise OnnxError(f"pad mode {mode!r} is not supported (constant, reflect, edge, wrap)")
    axes = [_axis(a, rank) for a in axes]
    n = len(axes)
    pairs = [[0, 0] for _ in range(rank)]
    for i, a in enumerate(axes):
        pairs[a] = [pads[i], pads[i + n]]
    t = tr.t(x)
    shape = list(x.shape)
    for a, (lo, hi) in enumerate(pairs):  # negative pads crop
        if lo < 0 or hi < 0:
            t, shape[a] = _slice_axis(tr, t, shape, a, max(0, -lo), shape[a] - max(0, -hi), 1)
            pairs[a] = [max(lo, 0), max(hi, 0)]
    if mode == "edge":  # the edge row repeated: an expanded slice on each side
        for a, (lo, hi) in enumerate(pairs):
            parts = []
            for width, at in ((lo, 0), (hi, shape[a] - 1)):
                if width:
                    edge = tr.op("slice", t, axis=a, start=at, stop=at + 1)
                    target = list(flare_shape(tuple(shape)))
                    target[a] = width
                    parts.append(tr.op("expand", edge, shape=target))
            if parts:
                pieces = ([parts[0]] if lo else []) + [t] + ([parts[-1]] if hi else [])
                t = pieces[0]
                for p in pieces[1:]:
                    t = tr.op("concat", t, p, axis=a)
                shape[a] += lo + hi
        if t is tr.t(x):
            t = tr.op("contiguous", t)
    elif mode == "wrap":  # the far end's rows before, the near end's after
        for a, (lo, hi) in enumerate(pairs):
            if lo > shape[a] or hi > shape[a]:
                raise OnnxError(f"wrap pad {(lo, hi)} wider than axis {a} ({shape[a]})")
            pieces = ([tr.op("slice", t, axis=a, start=shape[a] - lo, stop=shape[a])] if lo else []) + [t] + \
                ([tr.op("slice", t, axis=a, start=0, stop=hi)] if hi else [])
            for p in pieces[1:]:
                pieces[0] = tr.op("concat", pieces[0], p, axis=a)
            t = pieces[0]
            shape[a] += lo + hi
        t = tr.op("contiguous", t)
    elif any(lo or hi for lo, hi in pairs) and mode == "constant" and not np.isfinite(value):
        # a pad op's value must be finite: pad with 0, then put the value where the mask says "padding"
        inside = np.pad(np.ones(shape, np.int32), pairs)
        t = tr.op("pad", t, pads=pairs, mode=mode, value=0.0)
        shape = [d + lo + hi for d, (lo, hi) in zip(shape, pairs)]
        t = tr.op("where", tr.t(cval(inside.reshape(flare_shape(tuple(shape))))), t, _full(tr, value, np.float32))
    elif any(lo or hi for lo, hi in pairs):
        joined = _pad_by_concat(tr, t, shape, pairs, value, x.dtype) if mode == "constant" else None
        t = joined if joined is not None else tr.op("pad", t, pads=pairs, mode=mode, value=value)
        shape = [d + lo + hi for d, (lo, hi) in zip(shape, pairs)]
    else:
        t = tr.op("contiguous", t)
    return [tr.val(t, tuple(shape), x.dtype)]


PAD_PIECE_ELEMENTS = 1 << 16  # the largest constant piece a Pad is joined with (else the pad op)


def _pad_by_concat(tr, t, shape: list, pairs: list, value: float, dtype):
    """A constant Pad of one axis as a concatenation with constant pieces, or None. Why: the
    concatenation is a row copy on every backend, ~7x the CPU's native pad op on VITS's
    relative-attention shapes ([1, 2, L, 2L - 1] padded by one column; 24 per Piper sentence)."""
    padded = [a for a, (lo, hi) in enumerate(pairs) if lo or hi]
    if len(padded) != 1 or len(shape) > MAX_RANK or tuple(t.shape) != tuple(shape) or is_wide(tuple(shape)):
        return None
    a = padded[0]
    rest = int(np.prod(shape, dtype=np.int64)) // max(shape[a], 1)
    if shape[a] == 0 or rest * max(pairs[a]) > PAD_PIECE_ELEMENTS:
        return None
    carrier = np.dtype(np.int32) if dtype == BOOL else np.dtype(dtype)
    for width, first in ((pairs[a][0], True), (pairs[a][1], False)):
        if width:
            piece_shape = list(shape)
            piece_shape[a] = width
            piece = tr.t(cval(np.full(piece_shape, value, carrier)))
            t = tr.op("concat", piece, t, axis=a) if first else tr.op("concat", t, piece, axis=a)
    return t


@lowers("Trilu")
def _trilu(tr, node, ins, attrs):
    x = ins[0]
    k = _ints(tr, ins[1])[0] if len(ins) > 1 and ins[1] is not None else 0
    n, m = x.shape[-2:]
    mask = np.tril(np.ones((n, m), bool), k) if not attrs.get("upper", 1) else np.triu(np.ones((n, m), bool), k)
    zero = _full(tr, 0, x.dtype if x.dtype != BOOL else np.int32)
    out = tr.op("where", tr.t(cval(mask)), tr.t(x), zero)
    return [tr.val(out, x.shape, x.dtype)]


@lowers("OneHot")
def _one_hot(tr, node, ins, attrs):
    idx, depth_v, values = ins
    depth = int(np.asarray(tr.c(depth_v)).reshape(-1)[0])
    rank = len(idx.shape) + 1
    axis = _axis(attrs.get("axis", -1), rank)
    t = tr.t(idx)
    if idx.dtype == F32:
        t = tr.op("cast", t, dtype="i64")
    elif idx.dtype == I32:
        t = tr.op("cast", t, dtype="i64")
    # negative indices count from the end (ONNX): i + depth where i < 0
    wrapped = tr.op("where", tr.op("less", t, _full(tr, 0, np.int64)), tr.op("int_add", t, _full(tr, depth, np.int64)), t)
    shape = list(idx.shape)
    shape.insert(axis, 1)
    col = tr.op("reshape", wrapped, shape=list(flare_shape(tuple(shape))))
    iota_shape = [1] * rank
    iota_shape[axis] = depth
    iota = tr.t(cval(np.arange(depth, dtype=np.int64).reshape(iota_shape)))
    hit = tr.op("equal", col, iota)
    off_on = np.asarray(tr.c(values)).reshape(-1)
    vd = values.dtype
    out = tr.op("where", hit, _full(tr, off_on[1], vd), _full(tr, off_on[0], vd))
    out_shape = tuple(idx.shape[:axis]) + (depth,) + tuple(idx.shape[axis:])
    return [tr.val(out, out_shape, vd)]


@lowers("GatherND")
def _gather_nd(tr, node, ins, attrs):
    x, idx = ins
    b = int(attrs.get("batch_dims", 0))
    k = idx.shape[-1]
    shape = (*idx.shape[:-1], *x.shape[b + k:])
    ti = tr.t(idx)
    if b == 0:  # index tuples as rows [m, k]: wide index tensors fit too
        ti = tr.op("reshape", ti, shape=[int(np.prod(idx.shape[:-1], dtype=np.int64)), k])
    return [tr.val(tr.op("gather_nd", tr.t(x), ti, batch_dims=b), shape, x.dtype)]


@lowers("ScatterND")
def _scatter_nd(tr, node, ins, attrs):
    x, idx, upd = ins
    mode = attrs.get("reduction", "none")
    k = idx.shape[-1]
    m = int(np.prod(idx.shape[:-1], dtype=np.int64))
    ti = tr.op("reshape", tr.t(idx), shape=[m, k])  # index tuples as rows: wide index tensors fit too
    tu = tr.op("reshape", tr.t(upd), shape=list(flare_shape((m, *x.shape[k:]))))
    return [tr.val(tr.op("scatter_nd", tr.t(x), ti, tu, mode=mode), x.shape, x.dtype)]


@lowers("ScatterElements", "Scatter")
def _scatter_elements(tr, node, ins, attrs):
    x, idx, upd = ins
    axis = _axis(attrs.get("axis", 0), len(x.shape))
    out = tr.op("scatter_elements", tr.t(x), tr.t(idx), tr.t(upd), axis=axis, mode=attrs.get("reduction", "none"))
    return [tr.val(out, x.shape, x.dtype)]


@lowers("ReverseSequence")
def _reverse_sequence(tr, node, ins, attrs):
    """The first sequence_lens[b] steps of each batch entry reversed: a gather along the time
    axis by an index made on the host from the lengths (read there when computed)."""
    x, lens_v = ins
    time_axis, batch_axis = int(attrs.get("time_axis", 0)), int(attrs.get("batch_axis", 1))
    lens = np.asarray(tr.c(lens_v)).reshape(-1).astype(np.int64)
    steps, batch = x.shape[time_axis], x.shape[batch_axis]
    if lens.shape != (batch,) or (lens < 0).any() or (lens > steps).any():
        raise OnnxError(f"sequence_lens {lens.tolist()} do not fit {batch} sequences of {steps} steps")
    t = np.arange(steps)[:, None]
    order = np.where(t < lens[None, :], lens[None, :] - 1 - t, t)  # [time, batch]
    if time_axis > batch_axis:
        order = order.T
    view = [1] * len(x.shape)
    view[time_axis], view[batch_axis] = steps, batch
    idx = np.broadcast_to(order.reshape(view), x.shape).astype(np.int64)
    out = tr.op("take_along_axis", tr.t(x), tr.t(cval(np.ascontiguousarray(idx))), axis=time_axis)
    return [tr.val(out, x.shape, x.dtype)]


def _scatter_into_zeros(tr, values, index, total: int, dtype):
    """A flat [rows, total] of zeros with `values` [rows, M] added at `index` [rows, M] (repeats add)."""
    rows = values.shape[0]
    zeros = tr.t(cval(np.zeros((rows, total), dtype=dtype)))
    return tr.op("scatter_elements", zeros, index, values, axis=1, mode="add")


@lowers("Col2Im")
def _col2im(tr, node, ins, attrs):
    """Blocks [N, C*K, L] summed back into an image [N, C, H, W] (2-D): a scatter-add at positions
    made on the host from the shapes; positions in the padding are dropped."""
    from .base import _need

    x = _need(ins[0], "input")
    image = _ints(tr, ins[1])
    block = _ints(tr, ins[2])
    if len(image) != 2 or len(block) != 2:
        raise OnnxError(f"Col2Im of a {len(image)}-D image (2-D is supported)")
    dil = list(attrs.get("dilations", [1, 1]))
    strides = list(attrs.get("strides", [1, 1]))
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    n, ck, length = x.shape
    k = block[0] * block[1]
    c = ck // k
    h, w = image
    nb = [(image[i] + pads[i] + pads[i + 2] - dil[i] * (block[i] - 1) - 1) // strides[i] + 1 for i in range(2)]
    if ck != c * k or nb[0] * nb[1] != length:
        raise OnnxError(f"input {x.shape} does not hold {c} channels of {block} blocks at {nb[0]}x{nb[1]} positions")
    ch, ki, kj, bi, bj = np.meshgrid(np.arange(c), np.arange(block[0]), np.arange(block[1]), np.arange(nb[0]),
                                     np.arange(nb[1]), indexing="ij")
    y = bi * strides[0] - pads[0] + ki * dil[0]
    xx = bj * strides[1] - pads[1] + kj * dil[1]
    inside = ((y >= 0) & (y < h) & (xx >= 0) & (xx < w)).reshape(-1)
    target = ((ch * h + y) * w + xx).reshape(-1)[inside]
    source = np.flatnonzero(inside)
    flat = tr.op("reshape", tr.t(x), shape=[n, ck * length])
    picked = tr.op("take", flat, tr.t(cval(source.astype(np.int64))), axis=1)
    index = tr.t(cval(np.ascontiguousarray(np.broadcast_to(target, (n, target.size)).astype(np.int64))))
    out = _scatter_into_zeros(tr, picked, index, c * h * w, np.float32)
    return [tr.val(out, (n, c, h, w), x.dtype)]


@lowers("MaxUnpool")
def _max_unpool(tr, node, ins, attrs):
    """Values put back at MaxPool's flat indices into a zero tensor of the unpooled shape."""
    x, idx = ins[0], ins[1]
    kernel, nd = list(attrs["kernel_shape"]), len(x.shape) - 2
    strides = list(attrs.get("strides", [1] * nd))
    pads = list(attrs.get("pads", [0] * (2 * nd)))
    default = tuple(x.shape[:2]) + tuple((x.shape[2 + i] - 1) * strides[i] - pads[i] - pads[i + nd] + kernel[i]
                                         for i in range(nd))
    out_shape = tuple(_ints(tr, ins[2])) if len(ins) > 2 and ins[2] is not None else default
    size = int(np.prod(x.shape, dtype=np.int64))
    values = tr.op("reshape", tr.t(x), shape=[1, size])
    index = tr.op("reshape", tr.t(idx), shape=[1, size])
    if out_shape != default:  # the indices count in the default shape: same coordinates, the larger shape's strides
        fd = "i64" if idx.dtype == np.dtype(np.int64) else "i32"
        np_fd = np.int64 if fd == "i64" else np.int32
        rest, coords = index, []
        for d in reversed(default[2:]):
            coords.append(tr.op("mod", rest, _full(tr, d, np_fd)))
            rest = tr.op("int_div", rest, _full(tr, d, np_fd))
        index = rest  # n * C + c
        for d, coord in zip(out_shape[2:], reversed(coords)):
            index = tr.op("int_add", tr.op("int_mul", index, _full(tr, d, np_fd)), coord)
    out = _scatter_into_zeros(tr, values, index, int(np.prod(out_shape, dtype=np.int64)), np.float32)
    return [tr.val(out, out_shape, x.dtype)]


@lowers("TensorScatter")
def _tensor_scatter(tr, node, ins, attrs):
    """The update's rows written into the cache along `axis` from each batch entry's write index
    (wrapping around in circular mode): one scatter at positions made on the host."""
    past, update = ins[0], ins[1]
    rank = len(past.shape)
    axis = _axis(attrs.get("axis", -2), rank)
    steps, count, batch = past.shape[axis], update.shape[axis], past.shape[0]
    start = np.zeros(batch, np.int64) if len(ins) < 3 or ins[2] is None else \
        np.asarray(tr.c(ins[2])).reshape(-1).astype(np.int64)
    pos = start[:, None] + np.arange(count)[None, :]  # [batch, count]
    if attrs.get("mode", "linear") == "circular":
        pos %= steps
    elif (pos >= steps).any() or (pos < 0).any():
        raise OnnxError(f"write indices {start.tolist()} + {count} rows overrun axis {axis} ({steps})")
    view = [1] * rank
    view[0], view[axis] = batch, count
    index = np.ascontiguousarray(np.broadcast_to(pos.reshape(view), update.shape).astype(np.int64))
    out = tr.op("scatter_elements", tr.t(past), tr.t(cval(index)), tr.t(update), axis=axis)
    return [tr.val(out, past.shape, past.dtype)]
