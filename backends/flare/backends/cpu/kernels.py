"""CPU kernels: each writes its result into `out`, a view of the planned arena.

Signature: `kernel(out, srcs, params) -> None`. They use NumPy's `out=` and
in-place forms so that executing a prepared graph allocates no device buffer.
Kernels of ops the registry marks in-place must tolerate `out` aliasing
`srcs[0]` (they read each element before writing it, or use a temporary).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .erf import erf_into

Kernel = Callable[[np.ndarray, Sequence[np.ndarray], Mapping[str, Any]], None]
KERNELS: dict[str, Kernel] = {}
# op -> variant name -> kernel; the first variant is the default (= KERNELS[op]).
# Tuning (flare.plugins.export.tuning) times them and a core records the best per program.
VARIANTS: dict[str, dict[str, Kernel]] = {}


def kernel(*names: str):
    def deco(fn: Kernel) -> Kernel:
        for name in names:
            KERNELS[name] = fn
        return fn
    return deco


_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}


def _binary(fn):
    return lambda out, x, p: fn(x[0], x[1], out=out)


for _name, _fn in _BINARY.items():
    KERNELS[_name] = _binary(_fn)


@kernel("scale")
def _scale(out, x, p):
    np.multiply(x[0], np.float32(p["scale"]), out=out)
    if p["bias"]:
        np.add(out, np.float32(p["bias"]), out=out)


@kernel("relu")
def _relu(out, x, p):
    np.maximum(x[0], np.float32(0), out=out)


@kernel("sigmoid")
def _sigmoid(out, x, p):
    np.negative(x[0], out=out)
    np.exp(out, out=out)
    np.add(out, np.float32(1), out=out)
    np.reciprocal(out, out=out)


@kernel("silu")
def _silu(out, x, p):
    s = np.exp(-x[0])
    s += np.float32(1)
    np.divide(x[0], s, out=out)


@kernel("gelu")
def _gelu(out, x, p):
    a = x[0]
    e = np.multiply(a, np.float32(0.7071067811865476))
    erf_into(e, e)
    e += np.float32(1)
    e *= np.float32(0.5)
    np.multiply(a, e, out=out)


for _name, _fn in {"tanh": np.tanh, "exp": np.exp, "sqrt": np.sqrt, "neg": np.negative, "sqr": np.square}.items():
    KERNELS[_name] = (lambda fn: lambda out, x, p: fn(x[0], out=out))(_fn)


@kernel("matmul")
def _matmul(out, x, p):
    a, b = x
    if p["transpose_b"]:
        b = np.swapaxes(b, -1, -2)
    if b.dtype != np.float32:
        b = b.astype(np.float32)
    np.matmul(a, b, out=out)


def _matmul_einsum(out, x, p):
    a, b = x
    if b.dtype != np.float32:
        b = b.astype(np.float32)
    np.einsum("...ik,...jk->...ij" if p["transpose_b"] else "...ik,...kj->...ij", a, b, out=out, optimize=False)


def _matmul_packed(out, x, p):
    """The right operand was stored pre-transposed and contiguous at compile time."""
    np.matmul(x[0], x[1], out=out)


VARIANTS["matmul"] = {"matmul": _matmul, "packed": _matmul_packed, "einsum": _matmul_einsum}


def _divide_by_rms(out: np.ndarray, v: np.ndarray, eps: float) -> None:
    """out = v / sqrt(mean(v^2, last axis) + eps): the shared tail of both norms."""
    ms = np.einsum("...i,...i->...", v, v)[..., None] / np.float32(v.shape[-1])
    ms += np.float32(eps)
    np.sqrt(ms, out=ms)
    np.divide(v, ms, out=out)


@kernel("layer_norm")
def _layer_norm(out, x, p):
    v = x[0]
    _divide_by_rms(out, v - v.mean(-1, keepdims=True), p["eps"])


@kernel("rms_norm")
def _rms_norm(out, x, p):
    _divide_by_rms(out, x[0], p["eps"])


@kernel("softmax")
def _softmax(out, x, p):
    np.multiply(x[0], np.float32(p["scale"]), out=out)
    if len(x) == 2:
        np.add(out, x[1], out=out)
    out -= out.max(-1, keepdims=True)
    np.exp(out, out=out)
    out /= out.sum(-1, keepdims=True)


@kernel("get_rows")
def _get_rows(out, x, p):
    out[...] = x[0][x[1]]


@kernel("rope")
def _rope(out, x, p):
    v, pos = x
    d = v.shape[-1]
    half = d // 2
    inv = (np.float64(p["base"]) ** (-2.0 * np.arange(half) / d))
    ang = pos.astype(np.float64)[:, None] * inv[None, :]
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    if p["neox"]:
        a, b = v[..., :half].copy(), v[..., half:].copy()
        oa, ob = out[..., :half], out[..., half:]
    else:
        a, b = v[..., 0::2].copy(), v[..., 1::2].copy()
        oa, ob = out[..., 0::2], out[..., 1::2]
    np.multiply(a, cos, out=oa)
    oa -= b * sin
    np.multiply(a, sin, out=ob)
    ob += b * cos


@kernel("leaky_relu")
def _leaky_relu(out, x, p):  # the fused chain's NumPy kernel (the device fuses it only when native)
    np.multiply(x[0], np.float32(p["alpha"]), out=out)
    np.copyto(out, x[0], where=x[0] > 0)


@kernel("conv1d")
def _conv1d(out, x, p):
    v, w = x
    s, pad, dil = p["stride"], p["padding"], p["dilation"]
    b, cin, _ = v.shape
    cout, _, k = w.shape
    if pad:
        v = np.pad(v, ((0, 0), (0, 0), (pad, pad)))
    lout = out.shape[2]
    if k == 1 and s == 1:
        np.matmul(w[:, :, 0].astype(np.float32, copy=False), v[:, :, :lout], out=out)
        return
    windows = np.lib.stride_tricks.sliding_window_view(v, (k - 1) * dil + 1, axis=2)[:, :, : (lout - 1) * s + 1: s, ::dil]
    cols = windows.transpose(0, 2, 1, 3).reshape(b * lout, cin * k)            # [B*L, Cin*K]
    wm = w.reshape(cout, cin * k).astype(np.float32, copy=False)
    # one GEMM over every batch row (B small batched GEMMs were twice as slow for silero's frontend)
    out[...] = (cols @ wm.T).reshape(b, lout, cout).transpose(0, 2, 1)


@kernel("lstm")
def _lstm(out, x, p):
    """The NumPy path: one [B, H] x [H, 4H] product and the cell update per step, in f32."""
    xs, w, h0, c0 = x
    hidden = w.shape[1]
    wt = np.ascontiguousarray(w.T, dtype=np.float32)
    h = h0.astype(np.float32, copy=True)
    c = c0.astype(np.float32, copy=True)
    z = np.empty((xs.shape[1], 4 * hidden), np.float32)
    for t in range(xs.shape[0]):
        np.matmul(h, wt, out=z)
        z += xs[t]
        _sigmoid(z[:, :2 * hidden], [z[:, :2 * hidden]], p)
        _sigmoid(z[:, 3 * hidden:], [z[:, 3 * hidden:]], p)
        np.tanh(z[:, 2 * hidden:3 * hidden], out=z[:, 2 * hidden:3 * hidden])
        c *= z[:, hidden:2 * hidden]
        c += z[:, :hidden] * z[:, 2 * hidden:3 * hidden]
        np.tanh(c, out=h)
        h *= z[:, 3 * hidden:]
        out[t, :, :hidden] = h
        out[t, :, hidden:] = c


@kernel("pad")
def _pad(out, x, p):
    pads = [tuple(pr) for pr in p["pads"]]
    if p["mode"] == "reflect":
        out[...] = np.pad(x[0], pads, mode="reflect")
        return
    out.fill(p["value"])
    inner = tuple(slice(lo, lo + d) for (lo, _), d in zip(pads, x[0].shape))
    out[inner] = x[0]


@kernel("concat")
def _concat(out, x, p):
    np.concatenate(x, axis=p["axis"], out=out)


@kernel("contiguous")
def _contiguous(out, x, p):
    np.copyto(out, x[0])


def _reduce(fn):
    def run(out, x, p):
        res = fn(x[0], axis=p["axis"], keepdims=p["keepdims"])
        out[...] = np.reshape(res, out.shape)
    return run


KERNELS["sum"] = _reduce(np.sum)
KERNELS["mean"] = _reduce(np.mean)
KERNELS["max"] = _reduce(np.max)


@kernel("argmax")
def _argmax(out, x, p):
    out[...] = np.argmax(x[0], axis=p["axis"]).reshape(out.shape)


@kernel("top_k")
def _top_k(out, x, p):
    out[...] = np.argsort(-x[0], axis=-1, kind="stable")[..., : p["k"]]


@kernel("gather")
def _gather(out, x, p):
    out[...] = np.take_along_axis(x[0], x[1].astype(np.intp), -1)


@kernel("mul_mat_id")
def _mul_mat_id(out, x, p):
    w, v, ids = x
    if not ((ids >= 0) & (ids < w.shape[0])).all():
        raise IndexError(f"mul_mat_id: expert ids outside 0..{w.shape[0] - 1}")
    t, kk = ids.shape
    flat_ids = ids.reshape(-1)
    rows = v.reshape(t, -1)[:, None, :] if v.ndim == 2 else v
    rows = np.broadcast_to(rows, (t, kk, w.shape[2])).reshape(t * kk, w.shape[2])
    flat_out = out.reshape(t * kk, w.shape[1])
    order = np.argsort(flat_ids, kind="stable")
    sorted_ids = flat_ids[order]
    bounds = np.flatnonzero(np.diff(sorted_ids)) + 1
    for group in np.split(order, bounds):
        if group.size == 0:
            continue
        expert = w[flat_ids[group[0]]]
        if expert.dtype != np.float32:
            expert = expert.astype(np.float32)
        flat_out[group] = rows[group] @ expert.T


def _mul_mat_id_gathered(out, x, p):
    """One batched matmul over the gathered expert matrices (fast for few tokens)."""
    w, v, ids = x
    t, kk = ids.shape
    rows = np.broadcast_to(v.reshape(t, -1)[:, None, :] if v.ndim == 2 else v, (t, kk, w.shape[2]))
    ws = w[ids]
    if ws.dtype != np.float32:
        ws = ws.astype(np.float32)
    np.matmul(ws, rows[..., None], out=out[..., None])


VARIANTS["mul_mat_id"] = {"grouped": _mul_mat_id, "gathered": _mul_mat_id_gathered}


@kernel("set_rows")
def _set_rows(out, x, p):
    out[x[1]] = x[2]


@kernel("copy_into")
def _copy_into(out, x, p):
    src = x[1]
    out.reshape(-1)[p["offset"]: p["offset"] + src.size] = src.reshape(-1)


@kernel("cast")
def _cast(out, x, p):
    v = x[0]
    if np.issubdtype(out.dtype, np.integer) and np.issubdtype(v.dtype, np.floating):
        v = np.trunc(v)
    out[...] = v


# -- fused ops: the NumPy fallback when a fused node's layout is one the C executor declines


@kernel("linear")
def _linear(out, x, p):
    _matmul(out, x[:2], p)
    if p["has_bias"]:
        np.add(out, x[2], out=out)
    if p["act"] != "none":
        KERNELS[p["act"]](out, [out], {})
    if p["has_residual"]:
        np.add(out, x[-1], out=out)


@kernel("norm_affine")
def _norm_affine(out, x, p):
    KERNELS[f"{p['norm']}_norm"](out, x[:1], p)
    np.multiply(out, x[1], out=out)
    if p["has_beta"]:
        np.add(out, x[2], out=out)


@kernel("attention")
def _attention(out, x, p):
    q, k, v = x[:3]
    scores = np.matmul(q, np.swapaxes(k, -1, -2))
    _softmax(scores, [scores, x[3]] if p["has_mask"] else [scores], p)
    np.matmul(scores, v, out=out)
from . import kernels_quant  # noqa: E402,F401  (block-quantized weights: dequantize, then the float kernels)
