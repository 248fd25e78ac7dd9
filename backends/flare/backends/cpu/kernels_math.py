"""CPU kernels of the ops in flare.core.ops.math_ops (unary math, min/max/pow/mod,
integer arithmetic, bitwise ops and shifts, comparisons, logic, where, min/prod/argmin/arg_max, cumsum).

Same contract as kernels.py: `kernel(out, srcs, params)` writes into `out`, a
contiguous view of the arena; float math runs in float32 with NumPy's ufuncs
(the references run in float64: the conformance tolerances cover the gap).
Registered into the CPU kernel table on import (device.py imports this module).
"""
from __future__ import annotations

import numpy as np

from flare.core.ops.math_ops import bit_shift, int_div, round_float

from .erf import erf_into
from .kernels import KERNELS

_UNARY = {
    "abs": np.abs, "ceil": np.ceil, "floor": np.floor, "round": np.rint, "sign": np.sign, "log": np.log,
    "reciprocal": np.reciprocal, "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin,
    "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh, "asinh": np.arcsinh,
    "acosh": np.arccosh, "atanh": np.arctanh,
}


def _unary(fn):
    def run(out, x, p):
        with np.errstate(all="ignore"):
            fn(x[0], out=out)
    return run


for _name, _fn in _UNARY.items():
    KERNELS[_name] = _unary(_fn)


def _erf(out, x, p):
    np.copyto(out, x[0])
    erf_into(out, out)


def _softplus(out, x, p):
    np.logaddexp(np.float32(0), x[0], out=out)


def _softsign(out, x, p):
    np.abs(x[0], out=out)
    out += np.float32(1)
    np.divide(x[0], out, out=out)


def _clamp(out, x, p):
    lo = None if p["lo"] is None else np.float32(p["lo"])
    hi = None if p["hi"] is None else np.float32(p["hi"])
    if lo is None and hi is None:
        np.copyto(out, x[0])
    else:
        np.clip(x[0], lo, hi, out=out)


KERNELS.update(erf=_erf, softplus=_softplus, softsign=_softsign, clamp=_clamp)


def _binary(fn):
    def run(out, x, p):
        with np.errstate(all="ignore"):
            fn(x[0], x[1], out=out)
    return run


def _mod(out, x, p):
    with np.errstate(all="ignore"):
        (np.fmod if p["fmod"] else np.mod)(x[0], x[1], out=out)


def _int_div(out, x, p):
    out[...] = int_div(x[0], x[1])


def _compare(fn):
    def run(out, x, p):
        out[...] = fn(x[0], x[1])
    return run


def _logical(fn):
    def run(out, x, p):
        out[...] = fn(x[0] != 0, x[1] != 0)
    return run


KERNELS.update(minimum=_binary(np.minimum), maximum=_binary(np.maximum), pow=_binary(np.power), mod=_mod,
               int_add=_binary(np.add), int_sub=_binary(np.subtract), int_mul=_binary(np.multiply), int_div=_int_div)
KERNELS.update(bitwise_and=_binary(np.bitwise_and), bitwise_or=_binary(np.bitwise_or),
               bitwise_xor=_binary(np.bitwise_xor))
KERNELS["bitwise_not"] = lambda out, x, p: np.invert(x[0], out=out)
KERNELS["bit_shift"] = lambda out, x, p: out.__setitem__(Ellipsis, bit_shift(x[0], x[1], p["mode"]))
KERNELS["bitcast"] = lambda out, x, p: out.view(x[0].dtype).__setitem__(Ellipsis, x[0])
KERNELS["round_float"] = lambda out, x, p: out.__setitem__(Ellipsis, round_float(x[0], p["mode"], p["saturate"]))
KERNELS.update(equal=_compare(np.equal), less=_compare(np.less), less_equal=_compare(np.less_equal),
               greater=_compare(np.greater), greater_equal=_compare(np.greater_equal))
KERNELS.update(logical_and=_logical(np.logical_and), logical_or=_logical(np.logical_or),
               logical_xor=_logical(np.logical_xor))
KERNELS["logical_not"] = lambda out, x, p: out.__setitem__(Ellipsis, x[0] == 0)
KERNELS["isnan"] = lambda out, x, p: out.__setitem__(Ellipsis, np.isnan(x[0]))
KERNELS["where"] = lambda out, x, p: out.__setitem__(Ellipsis, np.where(x[0] != 0, x[1], x[2]))


def _reduce(fn):
    def run(out, x, p):
        out[...] = np.reshape(fn(x[0], axis=p["axis"], keepdims=p["keepdims"]), out.shape)
    return run


def _arg(fn):
    def run(out, x, p):
        v = x[0]
        axis = p["axis"] % v.ndim
        if p["select_last"]:
            res = v.shape[axis] - 1 - fn(np.flip(v, axis), axis=axis)
        else:
            res = fn(v, axis=axis)
        out[...] = np.reshape(res, out.shape)
    return run


def _cumsum(out, x, p):
    v = x[0]
    axis = p["axis"] % v.ndim
    work = np.flip(v, axis) if p["reverse"] else v
    acc = np.cumsum(work, axis=axis, dtype=v.dtype)
    if p["exclusive"]:
        acc -= work
    out[...] = np.flip(acc, axis) if p["reverse"] else acc


KERNELS.update(min=_reduce(np.min), prod=_reduce(np.prod), argmin=_arg(np.argmin), arg_max=_arg(np.argmax),
               cumsum=_cumsum)


def _cumprod(out, x, p):
    from flare.core.ops.math_ops import cumprod_ref

    out[...] = cumprod_ref(x, p)  # float64 products, one rounding: the reference is the kernel


KERNELS["cumprod"] = _cumprod
