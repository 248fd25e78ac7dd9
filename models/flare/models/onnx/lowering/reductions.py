"""MatMul, Gemm, Softmax family, reductions, ArgMax/ArgMin, CumSum/CumProd, LpNormalization, TopK."""
from __future__ import annotations

import numpy as np

from ..errors import OnnxError
from ..values import BOOL, Val, is_wide
from .base import F32, I64, INTS, _axis, _full, _identity, _ints, _last_axis_apply, _need, _reduce_chain, cval, lowers


# -- matrix products ------------------------------------------------------------------
@lowers("MatMul")
def _matmul(tr, node, ins, attrs):
    a, b = _need(ins[0], "A"), _need(ins[1], "B")
    packed = _by_constant_matrix(tr, a, b)
    if packed is not None:
        return [packed]
    ta, tb = tr.t(a), tr.t(b)
    a_shape, b_shape = a.shape, b.shape
    if len(a_shape) == 1:
        ta = tr.op("reshape", ta, shape=[1, a_shape[0]])
        a_shape = (1, a_shape[0])
    if len(b_shape) == 1:
        tb = tr.op("reshape", tb, shape=[b_shape[0], 1])
        b_shape = (b_shape[0], 1)
    out_shape = (*np.broadcast_shapes(a_shape[:-2], b_shape[:-2]), a_shape[-2], b_shape[-1])
    if len(a.shape) == 1:
        out_shape = out_shape[:-2] + out_shape[-1:]
    if len(b.shape) == 1:
        out_shape = out_shape[:-1]
    return [tr.val(tr.op("matmul", ta, tb), out_shape, F32)]


def _by_constant_matrix(tr, a: Val, b: Val) -> Val | None:
    """A @ B with B a constant matrix (leading axes all 1, shared by every row of A) as one
    [rows, K] x [N, K]^T product with B stored transposed: the layout of a linear layer's
    weight, which backends pre-pack once per plan (the CPU's packed microkernel) instead of
    packing B on every call. VITS's relative-position attention multiplies by such constants
    12 times a sentence. B of the file is transposed once per runner; a computed one per trace.
    None where this does not apply (B is data, batched, or A is a vector)."""
    if b.const is None or b.runtime or len(a.shape) < 2 or len(b.shape) < 2 or len(b.shape) > len(a.shape) \
            or any(d != 1 for d in b.shape[:-2]) or is_wide(a.shape):
        return None
    k, n = b.shape[-2:]
    if a.shape[-1] != k:
        return None
    if b.fixed and b.name:
        key = ("matmul_transposed", b.name)
        hit = tr.runner.derived.get(key)
        if hit is None or hit[0] is not b.const:
            hit = tr.runner.derived[key] = (b.const, np.ascontiguousarray(np.asarray(b.const, np.float32).reshape(k, n).T))
        wt = Val(f"{b.name}#transposed", (n, k), np.dtype(np.float32), const=hit[1], fixed=True)
    else:
        wt = cval(np.ascontiguousarray(np.asarray(b.const, np.float32).reshape(k, n).T))
    rows = int(np.prod(a.shape[:-1], dtype=np.int64))
    out = tr.op("matmul", tr.op("reshape", tr.t(a), shape=[rows, k]), tr.t(wt), transpose_b=True)
    return tr.val(out, (*a.shape[:-1], n), F32)


@lowers("Gemm")
def _gemm(tr, node, ins, attrs):
    a, b = _need(ins[0], "A"), _need(ins[1], "B")
    ta = tr.t(a)
    if attrs.get("transA", 0):
        ta = tr.op("transpose", ta)
    out = tr.op("matmul", ta, tr.t(b), transpose_b=bool(attrs.get("transB", 0)))
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    if alpha != 1.0:
        out = tr.op("scale", out, scale=alpha)
    if len(ins) > 2 and ins[2] is not None and beta != 0.0:
        c = tr.t(ins[2])
        if beta != 1.0:
            c = tr.op("scale", c, scale=beta)
        out = tr.op("add", out, c)
    return [tr.val(out, tuple(out.shape), F32)]


@lowers("Softmax", "LogSoftmax", "Hardmax")
def _softmax(tr, node, ins, attrs):
    x = _need(ins[0], "input")
    rank = len(x.shape)
    t = tr.t(x)
    log = node.op_type == "LogSoftmax"

    def soft(u):
        if node.op_type == "Hardmax":  # one-hot of the first maximum over the last axis
            n = u.shape[-1]
            idx = tr.op("arg_max", u, axis=-1, keepdims=True)
            iota = tr.t(cval(np.arange(n, dtype=np.int32)))
            return tr.op("cast", tr.op("equal", idx, iota), dtype="f32")
        s = tr.op("softmax", u)
        return tr.op("log", s) if log else s

    if tr.opset < 13:
        axis = _axis(attrs.get("axis", 1), rank)
        outer = int(np.prod(x.shape[:axis], dtype=np.int64))
        flat = tr.op("reshape", t, shape=[outer, int(np.prod(x.shape[axis:], dtype=np.int64))])
        return [tr.val(soft(flat), x.shape, F32)]
    axis = _axis(attrs.get("axis", -1), rank)
    return [tr.val(tr.op("contiguous", _last_axis_apply(tr, t, rank, axis, soft)), x.shape, F32)]


def _reduce_axes(tr, node, ins, attrs) -> tuple[list[int] | None, bool]:
    """Axes (None: all) and keepdims, from the attribute or (newer opsets) the second input."""
    axes = attrs.get("axes")
    if len(ins) > 1 and ins[1] is not None:
        axes = _ints(tr, ins[1])
    keep = bool(attrs.get("keepdims", 1))
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return [], keep
        return None, keep
    return list(axes), keep


_REDUCE = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max", "ReduceMin": "min", "ReduceProd": "prod",
           "ReduceL1": "sum", "ReduceL2": "sum", "ReduceSumSquare": "sum", "ReduceLogSum": "sum",
           "ReduceLogSumExp": "sum"}


@lowers(*_REDUCE)
def _reduce(tr, node, ins, attrs):
    x = ins[0]
    axes, keep = _reduce_axes(tr, node, ins, attrs)
    kind = node.op_type
    if axes == []:
        return _identity(tr, node, ins, attrs)
    if is_wide(x.shape):  # rank > 4: only reductions over every axis, of the flattened values
        rank = len(x.shape)
        if axes is not None and sorted({_axis(a, rank) for a in axes}) != list(range(rank)):
            raise OnnxError(f"reduction over some axes of a rank-{rank} value")
        flat = Val(x.name, (int(np.prod(x.shape, dtype=np.int64)),), x.dtype,
                   tensor=tr.op("reshape", tr.t(x), shape=[int(np.prod(x.shape, dtype=np.int64))]))
        out = _reduce(tr, node, [flat, None], {**attrs, "axes": [0], "keepdims": 0})[0]
        shape = (1,) * rank if keep else ()
        return [tr.val(out.tensor, shape, out.dtype) if out.tensor is not None else cval(np.asarray(out.const).reshape(shape))]
    if x.dtype == BOOL and kind in ("ReduceMax", "ReduceMin"):  # any / all over i32 0/1
        t, shape = _reduce_chain(tr, tr.t(x), x.shape, axes, keep, "min")
        if kind == "ReduceMax":
            neg = tr.op("int_sub", _full(tr, 1, np.int32), tr.t(x))
            t, shape = _reduce_chain(tr, neg, x.shape, axes, keep, "min")
            t = tr.op("int_sub", _full(tr, 1, np.int32), t)
        return [tr.val(t, shape, BOOL)]
    if x.dtype != F32 and kind not in ("ReduceMin", "ReduceProd"):
        if kind == "ReduceSum" and x.dtype in INTS:  # exact integer sums: the last element of a cumsum
            t = tr.t(x)
            rank = len(x.shape)
            red = sorted({_axis(a, rank) for a in (range(rank) if axes is None else axes)})
            for a in red:
                n = x.shape[a]
                t = tr.op("slice", tr.op("cumsum", t, axis=a), axis=a, start=n - 1, stop=n)
            shape = tuple(1 if i in red else d for i, d in enumerate(x.shape)) if keep else \
                tuple(d for i, d in enumerate(x.shape) if i not in red)
            return [tr.val(tr.op("contiguous", t), shape, x.dtype)]
        if kind == "ReduceMax" and x.dtype in INTS:
            t = tr.op("int_sub", _full(tr, 0, x.dtype), tr.t(x))
            t, shape = _reduce_chain(tr, t, x.shape, axes, keep, "min")
            return [tr.val(tr.op("int_sub", _full(tr, 0, x.dtype), t), shape, x.dtype)]
        _need(x, "data")
    t = tr.t(x)
    if kind == "ReduceL1":
        t = tr.op("abs", t)
    elif kind in ("ReduceL2", "ReduceSumSquare"):
        t = tr.op("sqr", t)
    elif kind == "ReduceLogSumExp":
        t = tr.op("exp", t)
    t, shape = _reduce_chain(tr, t, x.shape, axes, keep, _REDUCE[kind])
    if kind == "ReduceL2":
        t = tr.op("sqrt", t)
    elif kind in ("ReduceLogSum", "ReduceLogSumExp"):
        t = tr.op("log", t)
    return [tr.val(t, shape, x.dtype)]


@lowers("ArgMax", "ArgMin")
def _arg(tr, node, ins, attrs):
    x = ins[0]
    rank = len(x.shape)
    axis = _axis(attrs.get("axis", 0), rank)
    keep = bool(attrs.get("keepdims", 1))
    op = "arg_max" if node.op_type == "ArgMax" else "argmin"
    out = tr.op(op, tr.t(x), axis=axis, keepdims=True, select_last=bool(attrs.get("select_last_index", 0)))
    shape = tuple(1 if i == axis else d for i, d in enumerate(x.shape)) if keep else \
        tuple(d for i, d in enumerate(x.shape) if i != axis)
    return [tr.val(tr.op("cast", out, dtype="i64"), shape, I64)]


@lowers("CumSum", "CumProd")
def _cumulative(tr, node, ins, attrs):
    x = ins[0]
    axis = _axis(_ints(tr, ins[1])[0], len(x.shape))
    out = tr.op(node.op_type.lower(), tr.t(x), axis=axis, exclusive=bool(attrs.get("exclusive", 0)),
                reverse=bool(attrs.get("reverse", 0)))
    return [tr.val(out, x.shape, x.dtype)]


@lowers("TopK")
def _topk(tr, node, ins, attrs):
    x = _need(ins[0], "X", (F32, np.dtype(np.int32), np.dtype(np.int64)))
    k = _ints(tr, ins[1])[0] if tr.opset >= 10 else int(attrs["k"])
    rank = len(x.shape)
    axis = _axis(attrs.get("axis", -1), rank)
    t = tr.t(x)
    if axis != rank - 1:
        perm = list(range(rank))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        t = tr.op("contiguous", tr.op("permute", t, axes=perm))
    if x.dtype == F32:
        src = t if attrs.get("largest", 1) else tr.op("neg", t)
        idx = tr.op("top_k", src, k=k)
    else:
        idx = _int_top_k(tr, t, k, bool(attrs.get("largest", 1)))
    vals = tr.op("take_along_axis", t, idx, axis=-1)
    if axis != rank - 1:
        vals = tr.op("permute", vals, axes=perm)
        idx = tr.op("permute", idx, axes=perm)
    shape = tuple(k if i == axis else d for i, d in enumerate(x.shape))
    return [tr.val(tr.op("contiguous", vals), shape, x.dtype), tr.val(tr.op("cast", idx, dtype="i64"), shape, I64)]


MAX_INT_TOPK = 2048  # the integer TopK compares every pair of a row's elements


def _int_top_k(tr, t, k: int, largest: bool):
    """TopK indices of an integer tensor, exactly (top_k is f32-only, and f32 cannot hold every
    int64): each element's rank is the number of elements that beat it (larger, or equal at a
    lower index), and the index of rank r is sum(i * (rank_i == r)) (exact in f32 for n < 2^24)."""
    shape = list(t.shape)
    n = shape[-1]
    if not 1 <= k <= n or n > MAX_INT_TOPK:
        raise OnnxError(f"integer TopK of {k} among {n} (at most {MAX_INT_TOPK} per row)")
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    flat = tr.op("reshape", t, shape=[rows, n])
    mine, other = tr.op("reshape", flat, shape=[rows, n, 1]), tr.op("reshape", flat, shape=[rows, 1, n])
    before = tr.t(cval((np.arange(n)[None, :] < np.arange(n)[:, None]).astype(np.int32).reshape(1, n, n)))
    beats = tr.op("logical_or", tr.op("greater" if largest else "less", other, mine),
                  tr.op("logical_and", tr.op("equal", other, mine), before))
    place = tr.op("sum", tr.op("cast", beats, dtype="f32"), axis=2, keepdims=False)  # [rows, n]
    wanted = tr.t(cval(np.arange(k, dtype=np.float32).reshape(1, k, 1)))
    hit = tr.op("cast", tr.op("equal", tr.op("reshape", place, shape=[rows, 1, n]), wanted), dtype="f32")
    iota = tr.t(cval(np.arange(n, dtype=np.float32).reshape(1, 1, n)))
    idx = tr.op("cast", tr.op("sum", tr.op("mul", hit, iota), axis=2, keepdims=False), dtype="i32")  # [rows, k]
    return tr.op("reshape", idx, shape=shape[:-1] + [k])


@lowers("LpNormalization")
def _lp_norm(tr, node, ins, attrs):
    x = _need(ins[0], "input")
    axis = _axis(attrs.get("axis", -1), len(x.shape))
    p = int(attrs.get("p", 2))
    t = tr.t(x)
    if p == 1:
        norm = tr.op("sum", tr.op("abs", t), axis=axis, keepdims=True)
    else:
        norm = tr.op("sqrt", tr.op("sum", tr.op("sqr", t), axis=axis, keepdims=True))
    zero = _full(tr, 0.0, np.float32)
    safe = tr.op("where", tr.op("equal", norm, zero), _full(tr, 1.0, np.float32), norm)
    return [tr.val(tr.op("div", t, safe), x.shape, F32)]


@lowers("TfIdfVectorizer")
def _tfidf(tr, node, ins, attrs):
    """N-gram counts of integer tokens, as onnx's reference counts them: for each skip distance d
    (1 .. max_skip_count + 1) every window of g tokens d apart (g from min to max gram length;
    unigrams at d = 1 only) that equals a pool n-gram adds one to that n-gram's output column.
    Per (d, g): the windows gathered by a constant index, compared with the pool's n-grams of
    length g, all-equal over the gram, summed over windows, placed by a constant one-hot matmul."""
    x = ins[0]
    if x.dtype not in INTS or "pool_strings" in attrs:
        raise OnnxError("TfIdfVectorizer of strings is not supported (integer tokens are)")
    if not 1 <= len(x.shape) <= 2:
        raise OnnxError(f"TfIdfVectorizer of a rank-{len(x.shape)} input ([C] or [B, C])")
    pool = np.asarray(attrs["pool_int64s"], dtype=np.int64)
    counts = list(attrs["ngram_counts"]) + [pool.size]
    indexes = list(attrs["ngram_indexes"])
    lo, hi, skips = int(attrs["min_gram_length"]), int(attrs["max_gram_length"]), int(attrs["max_skip_count"])
    out_size = max(indexes) + 1
    rows, n = (1, x.shape[0]) if len(x.shape) == 1 else x.shape
    tokens = tr.op("reshape", tr.t(x), shape=[rows, n])
    held = np.int32 if x.dtype == np.dtype(np.int32) else np.int64
    total, first_id = None, 0
    for g in range(1, len(counts)):
        grams = pool[counts[g - 1]:counts[g]].reshape(-1, g)
        ids = list(range(first_id, first_id + len(grams)))
        first_id += len(grams)
        if not lo <= g <= hi or not len(grams):
            continue
        place = np.zeros((len(grams), out_size), np.float32)
        place[np.arange(len(grams)), [indexes[i] for i in ids]] = 1.0
        for d in range(1, skips + 2):
            if g == 1 and d > 1:
                break  # unigrams are counted once
            windows = n - d * (g - 1)
            if windows <= 0:
                continue
            where = (np.arange(windows)[:, None] + d * np.arange(g)[None, :]).reshape(-1)
            picked = tr.op("reshape", tr.op("take", tokens, tr.t(cval(where.astype(np.int64))), axis=1),
                           shape=[rows, windows, 1, g])
            same = tr.op("equal", picked, tr.t(cval(grams.astype(held).reshape(1, 1, len(grams), g))))
            every = tr.op("min", same, axis=3, keepdims=False)  # [rows, windows, M]: all tokens match
            found = tr.op("sum", tr.op("cast", every, dtype="f32"), axis=1, keepdims=False)  # [rows, M]
            part = tr.op("matmul", found, tr.t(cval(np.ascontiguousarray(place.T))), transpose_b=True)
            total = part if total is None else tr.op("add", total, part)
    if total is None:
        total = tr.t(cval(np.zeros((rows, out_size), np.float32)))
    mode = attrs.get("mode", "TF")
    weights = attrs.get("weights")
    if mode == "IDF":
        hit = tr.op("cast", tr.op("greater", total, _full(tr, 0.0, np.float32)), dtype="f32")
        total = tr.op("mul", hit, tr.t(cval(np.asarray(weights, np.float32)))) if weights else hit
    elif mode == "TFIDF" and weights:
        total = tr.op("mul", total, tr.t(cval(np.asarray(weights, np.float32))))
    shape = (out_size,) if len(x.shape) == 1 else (rows, out_size)
    return [tr.val(total, shape, F32)]


@lowers("Det")
def _det(tr, node, ins, attrs):
    """Determinants of 2x2 and 3x3 matrices [..., n, n] by their cofactor expansion (products of
    gathered entries); larger ones are not supported."""
    x = _need(ins[0], "X")
    n = x.shape[-1]
    if len(x.shape) < 2 or x.shape[-2] != n or n not in (2, 3):
        raise OnnxError(f"Det of {x.shape} (2x2 and 3x3 matrices are supported)")
    batch = int(np.prod(x.shape[:-2], dtype=np.int64))
    flat = tr.op("reshape", tr.t(x), shape=[batch, n * n])

    def entry(i, j):
        return tr.op("take", flat, tr.t(cval(np.array([i * n + j], np.int64))), axis=1)  # [batch, 1]

    def product(*cells):
        out = entry(*cells[0])
        for cell in cells[1:]:
            out = tr.op("mul", out, entry(*cell))
        return out

    if n == 2:
        det = tr.op("sub", product((0, 0), (1, 1)), product((0, 1), (1, 0)))
    else:
        plus = [((0, 0), (1, 1), (2, 2)), ((0, 1), (1, 2), (2, 0)), ((0, 2), (1, 0), (2, 1))]
        minus = [((0, 2), (1, 1), (2, 0)), ((0, 1), (1, 0), (2, 2)), ((0, 0), (1, 2), (2, 1))]
        det = tr.op("sub", tr.op("add", tr.op("add", *[product(*c) for c in plus[:2]]), product(*plus[2])),
                    tr.op("add", tr.op("add", *[product(*c) for c in minus[:2]]), product(*minus[2])))
    return [tr.val(det, tuple(x.shape[:-2]), F32)]
