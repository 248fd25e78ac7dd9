"""Neural-network ops: norms, softmax, embedding lookup, rope, conv1d, an LSTM
recurrence, expert matmul, cache writes, gather and cast."""
from __future__ import annotations

import numpy as np

from ..dtypes import DTYPES, QUANT, to_numpy
from .quant import as_float, logical_shape
from ..errors import DTypeError, ShapeError
from .registry import OpDef, broadcast, need_dtype, need_rank, register


def _same_f32(op):
    def infer(node, srcs, params):
        need_dtype(node, op, srcs[0], ("f32",))
        return srcs[0].shape, "f32"
    return infer


def _layer_norm_ref(x, p):
    v = x[0].astype(np.float64)
    mu = v.mean(-1, keepdims=True)
    var = ((v - mu) ** 2).mean(-1, keepdims=True)
    return ((v - mu) / np.sqrt(var + p["eps"])).astype(np.float32)


def _rms_norm_ref(x, p):
    v = x[0].astype(np.float64)
    return (v / np.sqrt((v * v).mean(-1, keepdims=True) + p["eps"])).astype(np.float32)


register(OpDef("layer_norm", (1, 1), _same_f32("layer_norm"), _layer_norm_ref, defaults={"eps": 1e-5}, inplace=True))
register(OpDef("rms_norm", (1, 1), _same_f32("rms_norm"), _rms_norm_ref, defaults={"eps": 1e-6}, inplace=True))


def _softmax_infer(node, srcs, params):
    x = srcs[0]
    need_dtype(node, "softmax", x, ("f32",))
    if len(srcs) == 2:
        need_dtype(node, "softmax", srcs[1], ("f32",))
        if broadcast(node, "softmax", x.shape, srcs[1].shape) != tuple(x.shape):
            raise ShapeError(f"softmax mask {srcs[1].shape} does not broadcast to {x.shape}", node)
    return x.shape, "f32"


def _softmax_ref(x, p):
    v = x[0].astype(np.float64) * p["scale"]
    if len(x) == 2:
        v = v + x[1].astype(np.float64)
    v = v - v.max(-1, keepdims=True)
    e = np.exp(v)
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


register(OpDef("softmax", (1, 2), _softmax_infer, _softmax_ref, defaults={"scale": 1.0}, inplace=True))


def _get_rows_infer(node, srcs, params):
    table, idx = srcs
    need_dtype(node, "get_rows", table, ("f32", "f16", *QUANT))
    need_dtype(node, "get_rows", idx, ("i32", "i64"))
    need_rank(node, "get_rows", table, (2,))
    if len(idx.shape) > 3:
        raise ShapeError(f"get_rows indices of rank {len(idx.shape)} (at most 3)", node)
    return (*idx.shape, logical_shape(table)[1]), "f32"


register(OpDef("get_rows", (2, 2), _get_rows_infer, lambda x, p: as_float(x[0][x[1]]).astype(np.float32),
               quant_srcs=(0,)))


def _rope_infer(node, srcs, params):
    x, pos = srcs
    need_dtype(node, "rope", x, ("f32",))
    need_dtype(node, "rope", pos, ("i32",))
    need_rank(node, "rope", x, (3,))
    if pos.shape != (x.shape[0],):
        raise ShapeError(f"rope positions {pos.shape} must be ({x.shape[0]},) for x {x.shape}", node)
    if x.shape[2] % 2:
        raise ShapeError(f"rope head dim {x.shape[2]} must be even", node)
    return x.shape, "f32"


def _rope_ref(x, p):
    v, pos = x[0].astype(np.float64), x[1].astype(np.float64)
    d = v.shape[-1]
    half = d // 2
    inv = p["base"] ** (-2.0 * np.arange(half) / d)
    ang = pos[:, None] * inv[None, :]                 # [N, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty_like(v)
    if p["neox"]:
        a, b = v[..., :half], v[..., half:]
        out[..., :half] = a * cos - b * sin
        out[..., half:] = a * sin + b * cos
    else:
        a, b = v[..., 0::2], v[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    return out.astype(np.float32)


register(OpDef("rope", (2, 2), _rope_infer, _rope_ref, defaults={"base": 10000.0, "neox": True}))


def _conv1d_infer(node, srcs, params):
    x, w = srcs
    need_dtype(node, "conv1d", x, ("f32",))
    need_dtype(node, "conv1d", w, ("f32", "f16"))
    need_rank(node, "conv1d", x, (3,))
    need_rank(node, "conv1d", w, (3,))
    b, cin, length = x.shape
    cout, cin_w, k = w.shape
    if cin != cin_w:
        raise ShapeError(f"conv1d input channels {cin} != weight channels {cin_w}", node)
    s, pad, dil = params["stride"], params["padding"], params["dilation"]
    if s < 1 or dil < 1 or pad < 0:
        raise ShapeError(f"conv1d stride {s}, dilation {dil}, padding {pad} out of range", node)
    lout = (length + 2 * pad - dil * (k - 1) - 1) // s + 1
    if lout < 1:
        raise ShapeError(f"conv1d output length {lout} for input length {length}", node)
    return (b, cout, lout), "f32"


def _conv1d_ref(x, p):
    v, w = x[0].astype(np.float64), x[1].astype(np.float64)
    s, pad, dil = p["stride"], p["padding"], p["dilation"]
    v = np.pad(v, ((0, 0), (0, 0), (pad, pad)))
    k = w.shape[2]
    lout = (v.shape[2] - dil * (k - 1) - 1) // s + 1
    cols = np.stack([v[:, :, j * dil: j * dil + s * (lout - 1) + 1: s] for j in range(k)], axis=2)  # [B,Cin,K,L]
    return np.einsum("bckl,ock->bol", cols, w).astype(np.float32)


register(OpDef("conv1d", (2, 2), _conv1d_infer, _conv1d_ref, defaults={"stride": 1, "padding": 0, "dilation": 1}))


def _lstm_infer(node, srcs, params):
    x, w, h0, c0 = srcs
    for t in srcs:
        need_dtype(node, "lstm", t, ("f32",))
    need_rank(node, "lstm", x, (3,))
    for t in (w, h0, c0):
        need_rank(node, "lstm", t, (2,))
    steps, batch, gates = x.shape
    hidden = w.shape[1]
    if hidden < 1 or w.shape[0] != 4 * hidden:
        raise ShapeError(f"lstm: w_hh {w.name!r} {w.shape} must be [4H, H] (gate blocks i, f, g, o)", node)
    if gates != 4 * hidden:
        raise ShapeError(f"lstm: x {x.name!r} {x.shape} must be [T, B, 4H] with H = {hidden} from w_hh", node)
    for t, what in ((h0, "h0"), (c0, "c0")):
        if tuple(t.shape) != (batch, hidden):
            raise ShapeError(f"lstm: {what} {t.name!r} {t.shape} must be [B, H] = ({batch}, {hidden})", node)
    return (steps, batch, 2 * hidden), "f32"


def _sigmoid64(v):
    return 1.0 / (1.0 + np.exp(-v))


def _lstm_ref(x, p):
    xs, w, h, c = (a.astype(np.float64) for a in x)
    hidden = w.shape[1]
    out = np.empty(xs.shape[:2] + (2 * hidden,))
    for t in range(xs.shape[0]):
        z = xs[t] + h @ w.T
        i, f, o = (_sigmoid64(z[:, k * hidden:(k + 1) * hidden]) for k in (0, 1, 3))
        g = np.tanh(z[:, 2 * hidden:3 * hidden])
        c = f * c + i * g
        h = o * np.tanh(c)
        out[t, :, :hidden], out[t, :, hidden:] = h, c
    return out.astype(np.float32)


# lstm(x, w_hh, h0, c0): T steps of an LSTM recurrence in one node, so a backend runs the
# whole sequence without returning to the host (one kernel on a GPU, one loop in C).
# x [T, B, 4H] is the input projection x_t W_ih^T + b_ih + b_hh (batched over all steps
# by the caller: it does not depend on the recurrence); w_hh [4H, H] in PyTorch's gate
# order (i, f, g, o); h0, c0 [B, H]. Output [T, B, 2H]: row t holds h_t then c_t, so the
# hidden states are a strided slice and the final state is the last row.
register(OpDef("lstm", (4, 4), _lstm_infer, _lstm_ref,
               doc="T LSTM steps from input projections x [T,B,4H], w_hh [4H,H], h0, c0 [B,H] -> [T,B,2H] (h_t, c_t)"))


def _mul_mat_id_infer(node, srcs, params):
    w, x, ids = srcs
    need_dtype(node, "mul_mat_id", w, ("f32", "f16", *QUANT))
    need_dtype(node, "mul_mat_id", x, ("f32",))
    need_dtype(node, "mul_mat_id", ids, ("i32",))
    need_rank(node, "mul_mat_id", w, (3,))
    need_rank(node, "mul_mat_id", ids, (2,))
    e, n, k = logical_shape(w)
    t, kk = ids.shape
    if x.shape not in ((t, k), (t, kk, k)):
        raise ShapeError(f"mul_mat_id x {x.shape} must be ({t}, {k}) or ({t}, {kk}, {k}) for w {w.shape}, ids {ids.shape}", node)
    return (t, kk, n), "f32"


def _mul_mat_id_ref(x, p):
    v, ids = x[1].astype(np.float64), x[2]
    if not ((ids >= 0) & (ids < x[0].shape[0])).all():
        raise IndexError(f"mul_mat_id ids out of range 0..{x[0].shape[0] - 1}")
    w = as_float(x[0])
    if v.ndim == 2:
        v = np.broadcast_to(v[:, None, :], (*ids.shape, v.shape[1]))
    return np.einsum("tjnk,tjk->tjn", w[ids], v).astype(np.float32)


register(OpDef("mul_mat_id", (3, 3), _mul_mat_id_infer, _mul_mat_id_ref, quant_srcs=(0,)))


def _set_rows_infer(node, srcs, params):
    dst, idx, src = srcs
    need_rank(node, "set_rows", dst, (2,))
    need_rank(node, "set_rows", src, (2,))
    need_dtype(node, "set_rows", idx, ("i32",))
    need_dtype(node, "set_rows", src, ("f32",))
    need_dtype(node, "set_rows", dst, ("f32", "f16"))
    if idx.shape != (src.shape[0],) or src.shape[1] != dst.shape[1]:
        raise ShapeError(f"set_rows dst {dst.shape}, idx {idx.shape}, src {src.shape} do not fit", node)
    _writable(node, "set_rows", dst)
    return dst.shape, dst.dtype


def _writable(node, op, dst):
    if dst.storage.role not in ("state", "cache") or not dst.is_contiguous:
        raise ShapeError(f"{op} must write into a contiguous state tensor, not {dst.name!r} ({dst.storage.role})", node)


def _set_rows_ref(x, p):
    out = x[0].copy()
    out[x[1]] = x[2].astype(out.dtype)
    return out


register(OpDef("set_rows", (3, 3), _set_rows_infer, _set_rows_ref, writes_src0=True))


def _copy_into_infer(node, srcs, params):
    dst, src = srcs
    _writable(node, "copy_into", dst)
    if src.dtype != "f32" and src.dtype != dst.dtype:
        raise DTypeError(f"copy_into {src.dtype} into {dst.dtype}", node)
    off = params["offset"]
    if off < 0 or off + src.size > dst.size:
        raise ShapeError(f"copy_into {src.size} elements at offset {off} overflows {dst.name!r} of {dst.size}", node)
    return dst.shape, dst.dtype


def _copy_into_ref(x, p):
    out = x[0].copy()
    flat = out.reshape(-1)
    flat[p["offset"]: p["offset"] + x[1].size] = x[1].reshape(-1).astype(out.dtype)
    return out


register(OpDef("copy_into", (2, 2), _copy_into_infer, _copy_into_ref, defaults={"offset": 0}, writes_src0=True))


def _gather_infer(node, srcs, params):
    x, idx = srcs
    need_dtype(node, "gather", x, ("f32",))
    need_dtype(node, "gather", idx, ("i32",))
    if x.shape[:-1] != idx.shape[:-1]:
        raise ShapeError(f"gather leading dims differ: x {x.shape}, idx {idx.shape}", node)
    return idx.shape, "f32"


register(OpDef("gather", (2, 2), _gather_infer, lambda x, p: np.take_along_axis(x[0], x[1].astype(np.int64), -1)))


def _cast_infer(node, srcs, params):
    if params["dtype"] not in DTYPES:
        raise DTypeError(f"cast to unknown dtype {params['dtype']!r}", node)
    if params["dtype"] in QUANT:
        raise DTypeError(f"cast to {params['dtype']}: quantizing is not an op (weights arrive quantized)", node)
    return srcs[0].shape, params["dtype"]


def _cast_ref(x, p):
    v = x[0]
    target = to_numpy(p["dtype"])
    if np.issubdtype(target, np.integer) and np.issubdtype(v.dtype, np.floating):
        v = np.trunc(v)
    return v.astype(target)


register(OpDef("cast", (1, 1), _cast_infer, _cast_ref, required=("dtype",)))
