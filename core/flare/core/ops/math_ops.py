"""More elementwise math, comparisons, logic and selection (what imported ONNX graphs need).

The original elementwise ops (`add`, `relu`, ...) are f32-only so that every
GPU kernel stays one simple shader; the ops here widen the set without
touching them:

- unary float math (`abs`, `log`, `sin`, `erf`, ...): f32 -> f32;
- `clamp`: f32 bounded by `lo`/`hi` params;
- `minimum`, `maximum`, `pow`, `mod`: same-dtype binary ops with broadcasting
  (f32, and i32/i64 for minimum/maximum/mod);
- `int_add`, `int_sub`, `int_mul`, `int_div`: integer arithmetic (i32/i64),
  division truncating toward zero as ONNX and C do;
- `bitwise_and`, `bitwise_or`, `bitwise_xor`, `bitwise_not` and `bit_shift`
  (`mode` left / right / right_logical) over i32/i64: shifts by a negative
  count or by the width or more give 0 (-1 for an arithmetic right shift of a
  negative value), as ONNX's BitShift defines it rather than C's masking;
- `round_float`: f32 values rounded (to nearest even) to a narrower float
  format (`mode`: bfloat16, float16, the float8 formats, float4_e2m1fn; the
  formats are ml_dtypes' ones) and held in f32 again, clamped to the format's
  finite range first when `saturate`; what an ONNX Cast to such a format does;
- `bitcast`: the bits of an f32/i32 (or i64) tensor read as the other dtype
  of the same width;
- comparisons (`equal`, `less`, ...) and logic (`logical_and`, ...): booleans
  are i32 0/1 (Flare has no bool dtype; the importer converts at the edges);
- `where(cond i32, a, b)`: selection with three-way broadcasting;
- `min`, `prod` reductions and `argmin` over one axis, `cumsum` along one axis.

References compute in float64 (integers exactly) and round once to the
output dtype, so they are the oracle the f32 kernels are checked against.
"""
from __future__ import annotations

import math

import numpy as np

from ..dtypes import to_numpy
from ..errors import DTypeError
from .reduce import _reduced_shape
from .registry import PARAMS, OpDef, _is_int, _is_num, broadcast, need_dtype, norm_axis, register

PARAMS.setdefault("lo", (lambda v: v is None or _is_num(v), "a number finite in float32, or null"))
PARAMS.setdefault("hi", (lambda v: v is None or _is_num(v), "a number finite in float32, or null"))
PARAMS.setdefault("fmod", (lambda v: isinstance(v, bool), "true or false"))
PARAMS.setdefault("exclusive", (lambda v: isinstance(v, bool), "true or false"))
PARAMS.setdefault("reverse", (lambda v: isinstance(v, bool), "true or false"))
PARAMS.setdefault("saturate", (lambda v: isinstance(v, bool), "true or false"))
PARAMS.setdefault("select_last", (lambda v: isinstance(v, bool), "true or false"))

INTS = ("i32", "i64")
NUMERIC = ("f32", "i32", "i64")

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _f64(fn):
    return lambda x: fn(x.astype(np.float64)).astype(np.float32)


UNARY_MATH = {
    "abs": np.abs, "ceil": np.ceil, "floor": np.floor, "round": np.rint, "sign": np.sign,
    "log": np.log, "reciprocal": lambda v: 1.0 / v, "sin": np.sin, "cos": np.cos, "tan": np.tan,
    "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh,
    "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh, "erf": _erf,
    "softplus": lambda v: np.logaddexp(0.0, v), "softsign": lambda v: v / (1.0 + np.abs(v)),
}


def _unary_infer(op):
    def infer(node, srcs, params):
        need_dtype(node, op, srcs[0], ("f32",))
        return srcs[0].shape, "f32"
    return infer


for _name, _fn in UNARY_MATH.items():
    register(OpDef(_name, (1, 1), _unary_infer(_name), (lambda f: lambda x, p: _quiet(f, x[0]))(_f64(_fn)),
                   doc="f32 -> f32, computed elementwise"))


def _quiet(fn, x):
    with np.errstate(all="ignore"):  # log(0) = -inf, asin(2) = nan: IEEE results, as the kernels give
        return fn(x)


def _clamp_ref(x, p):
    v = x[0]
    lo = -np.inf if p["lo"] is None else p["lo"]
    hi = np.inf if p["hi"] is None else p["hi"]
    return np.minimum(np.maximum(v, np.float32(lo)), np.float32(hi)).astype(np.float32)


register(OpDef("clamp", (1, 1), _unary_infer("clamp"), _clamp_ref, defaults={"lo": None, "hi": None}))


def _same_dtype_binary(op, allowed, out_dtype=None):
    def infer(node, srcs, params):
        a, b = srcs
        need_dtype(node, op, a, allowed)
        if b.dtype != a.dtype:
            raise DTypeError(f"{op}: inputs have dtypes {a.dtype} and {b.dtype}; expected one dtype", node)
        return broadcast(node, op, a.shape, b.shape), out_dtype or a.dtype
    return infer


def _mod_ref(x, p):
    a, b = x
    with np.errstate(all="ignore"):
        if p["fmod"]:
            return np.fmod(a, b).astype(a.dtype)
        return np.mod(a, b).astype(a.dtype)


def _pow_ref(x, p):
    with np.errstate(all="ignore"):
        return np.power(x[0].astype(np.float64), x[1].astype(np.float64)).astype(np.float32)


register(OpDef("minimum", (2, 2), _same_dtype_binary("minimum", NUMERIC), lambda x, p: np.minimum(x[0], x[1])))
register(OpDef("maximum", (2, 2), _same_dtype_binary("maximum", NUMERIC), lambda x, p: np.maximum(x[0], x[1])))
register(OpDef("pow", (2, 2), _same_dtype_binary("pow", ("f32",)), _pow_ref))
register(OpDef("mod", (2, 2), _same_dtype_binary("mod", NUMERIC), _mod_ref, defaults={"fmod": False}))


def int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division truncating toward zero (ONNX, C); division by zero gives 0, not a trap."""
    safe = np.where(b == 0, 1, b)
    q = np.abs(a) // np.abs(safe)
    return np.where(b == 0, 0, np.where((a < 0) ^ (safe < 0), -q, q)).astype(a.dtype)


INT_ARITH = {"int_add": np.add, "int_sub": np.subtract, "int_mul": np.multiply, "int_div": int_div}
for _name, _fn in INT_ARITH.items():
    register(OpDef(_name, (2, 2), _same_dtype_binary(_name, INTS),
                   (lambda f: lambda x, p: f(x[0], x[1]).astype(x[0].dtype))(_fn)))

COMPARISONS = {"equal": np.equal, "less": np.less, "less_equal": np.less_equal,
               "greater": np.greater, "greater_equal": np.greater_equal}
for _name, _fn in COMPARISONS.items():
    register(OpDef(_name, (2, 2), _same_dtype_binary(_name, NUMERIC, "i32"),
                   (lambda f: lambda x, p: f(x[0], x[1]).astype(np.int32))(_fn)))

LOGICAL = {"logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor}
for _name, _fn in LOGICAL.items():
    register(OpDef(_name, (2, 2), _same_dtype_binary(_name, ("i32",)),
                   (lambda f: lambda x, p: f(x[0] != 0, x[1] != 0).astype(np.int32))(_fn)))


BITWISE = {"bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor}
for _name, _fn in BITWISE.items():
    register(OpDef(_name, (2, 2), _same_dtype_binary(_name, INTS),
                   (lambda f: lambda x, p: f(x[0], x[1]).astype(x[0].dtype))(_fn)))


def _bitwise_not_infer(node, srcs, params):
    need_dtype(node, "bitwise_not", srcs[0], INTS)
    return srcs[0].shape, srcs[0].dtype


register(OpDef("bitwise_not", (1, 1), _bitwise_not_infer, lambda x, p: np.invert(x[0])))

SHIFT_MODES = ("left", "right", "right_logical")


def bit_shift(a: np.ndarray, b: np.ndarray, mode: str) -> np.ndarray:
    """a shifted by b bits (both i32 or i64, broadcast). A count outside 0..width-1 gives 0, or -1
    for an arithmetic right shift of a negative value; `right_logical` shifts in zeros (the
    unsigned view), as for uint64 values carried in i64."""
    a, b = np.broadcast_arrays(a, b)
    width = a.dtype.itemsize * 8
    unsigned = np.dtype(f"u{a.dtype.itemsize}")
    valid = (b >= 0) & (b < width)
    count = np.where(valid, b, 0).astype(unsigned)
    if mode == "left":
        out = np.left_shift(a.view(unsigned), count).view(a.dtype)
        return np.where(valid, out, 0).astype(a.dtype)
    if mode == "right_logical":
        out = np.right_shift(a.view(unsigned), count).view(a.dtype)
        return np.where(valid, out, 0).astype(a.dtype)
    out = np.right_shift(a, count.astype(a.dtype))
    return np.where(valid, out, np.where(a < 0, -1, 0)).astype(a.dtype)


def _shift_infer(node, srcs, params):
    if params["mode"] not in SHIFT_MODES:
        raise DTypeError(f"bit_shift: mode {params['mode']!r} is not one of {', '.join(SHIFT_MODES)}", node)
    return _same_dtype_binary("bit_shift", INTS)(node, srcs, params)


register(OpDef("bit_shift", (2, 2), _shift_infer, lambda x, p: bit_shift(x[0], x[1], p["mode"]), required=("mode",)))


FLOAT_FORMATS = ("bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                 "float4_e2m1fn")


def round_float(x: np.ndarray, fmt: str, saturate: bool) -> np.ndarray:
    """x (f32) rounded to the float format `fmt` and back to f32; with `saturate` values beyond the
    format's range (infinities too) become its largest finite value, else they become what the
    format makes of them (inf, or NaN where it has no inf). The formats are ml_dtypes' dtypes."""
    import ml_dtypes

    dtype = np.dtype(getattr(ml_dtypes, fmt) if fmt != "float16" else np.float16)
    if saturate:
        info = ml_dtypes.finfo(dtype)
        x = np.clip(x, np.float32(info.min), np.float32(info.max))
    with np.errstate(all="ignore"):
        return x.astype(dtype).astype(np.float32)


def _round_float_infer(node, srcs, params):
    need_dtype(node, "round_float", srcs[0], ("f32",))
    if params["mode"] not in FLOAT_FORMATS:
        raise DTypeError(f"round_float: mode {params['mode']!r} is not one of {', '.join(FLOAT_FORMATS)}", node)
    return srcs[0].shape, "f32"


register(OpDef("round_float", (1, 1), _round_float_infer, lambda x, p: round_float(x[0], p["mode"], p["saturate"]),
               defaults={"saturate": False}, required=("mode",)))


def _bitcast_infer(node, srcs, params):
    src, dtype = srcs[0], params["dtype"]
    need_dtype(node, "bitcast", src, NUMERIC)
    if dtype not in NUMERIC or to_numpy(dtype).itemsize != to_numpy(src.dtype).itemsize:
        raise DTypeError(f"bitcast: {src.dtype} to {dtype!r}: the dtypes must be of {'/'.join(NUMERIC)} and "
                         f"of one width", node)
    return src.shape, dtype


register(OpDef("bitcast", (1, 1), _bitcast_infer,
               lambda x, p: np.ascontiguousarray(x[0]).view(to_numpy(p["dtype"])), required=("dtype",)))


def _not_infer(node, srcs, params):
    need_dtype(node, "logical_not", srcs[0], ("i32",))
    return srcs[0].shape, "i32"


register(OpDef("logical_not", (1, 1), _not_infer, lambda x, p: (x[0] == 0).astype(np.int32)))


def _isnan_infer(node, srcs, params):
    need_dtype(node, "isnan", srcs[0], ("f32",))
    return srcs[0].shape, "i32"


register(OpDef("isnan", (1, 1), _isnan_infer, lambda x, p: np.isnan(x[0]).astype(np.int32)))


def _where_infer(node, srcs, params):
    cond, a, b = srcs
    need_dtype(node, "where", cond, ("i32",))
    need_dtype(node, "where", a, NUMERIC)
    if b.dtype != a.dtype:
        raise DTypeError(f"where: branches have dtypes {a.dtype} and {b.dtype}", node)
    return broadcast(node, "where", cond.shape, a.shape, b.shape), a.dtype


register(OpDef("where", (3, 3), _where_infer, lambda x, p: np.where(x[0] != 0, x[1], x[2]).astype(x[1].dtype)))


# -- reductions and scans over one axis ----------------------------------------------
def _reduce_infer(op, allowed, out=None):
    def infer(node, srcs, params):
        need_dtype(node, op, srcs[0], allowed)
        return _reduced_shape(node, op, srcs[0], params["axis"], params.get("keepdims", False)), out or srcs[0].dtype
    return infer


def _np_reduce(fn):
    def ref(x, p):
        v = x[0].astype(np.float64) if x[0].dtype == np.float32 else x[0]
        res = fn(v, axis=p["axis"], keepdims=p["keepdims"])
        shape = list(x[0].shape)
        axis = p["axis"] % len(shape)
        if p["keepdims"]:
            shape[axis] = 1
        else:
            del shape[axis]
        return np.asarray(res).astype(x[0].dtype).reshape(tuple(shape) or (1,))
    return ref


register(OpDef("min", (1, 1), _reduce_infer("min", NUMERIC), _np_reduce(np.min),
               defaults={"keepdims": False}, required=("axis",)))
register(OpDef("prod", (1, 1), _reduce_infer("prod", NUMERIC), _np_reduce(np.prod),
               defaults={"keepdims": False}, required=("axis",)))


def _argmin_ref(x, p):
    v = x[0]
    axis = p["axis"] % v.ndim
    if p["select_last"]:
        flipped = np.flip(v, axis)
        res = v.shape[axis] - 1 - np.argmin(flipped, axis=axis)
    else:
        res = np.argmin(v, axis=axis)
    if p["keepdims"]:
        res = np.expand_dims(res, axis)
    return res.astype(np.int32).reshape(_reduced_shape("ref", "argmin", v, axis, p["keepdims"]))


def _argmax_ref(x, p):
    return _argmin_ref([-x[0] if x[0].dtype.kind == "f" else -x[0].astype(np.int64)], p)


register(OpDef("argmin", (1, 1), _reduce_infer("argmin", NUMERIC, "i32"), _argmin_ref,
               defaults={"keepdims": False, "select_last": False}, required=("axis",)))
register(OpDef("arg_max", (1, 1), _reduce_infer("arg_max", NUMERIC, "i32"), _argmax_ref,
               defaults={"keepdims": False, "select_last": False}, required=("axis",),
               doc="argmax with keepdims and last-index ties (the older `argmax` has neither)"))


def _cumsum_infer(node, srcs, params):
    need_dtype(node, "cumsum", srcs[0], NUMERIC)
    norm_axis(node, "cumsum", params["axis"], len(srcs[0].shape))
    return srcs[0].shape, srcs[0].dtype


def cumsum_ref(x, p):
    v = x[0]
    axis = p["axis"] % v.ndim
    work = np.flip(v, axis) if p["reverse"] else v
    acc = np.cumsum(work.astype(np.float64) if v.dtype == np.float32 else work, axis=axis)
    if p["exclusive"]:
        acc = acc - (work.astype(acc.dtype))
    if p["reverse"]:
        acc = np.flip(acc, axis)
    return acc.astype(v.dtype)


register(OpDef("cumsum", (1, 1), _cumsum_infer, cumsum_ref, defaults={"exclusive": False, "reverse": False},
               required=("axis",)))

__all__ = ["UNARY_MATH", "COMPARISONS", "LOGICAL", "INT_ARITH", "int_div", "cumsum_ref", "to_numpy", "_is_int"]


def cumprod_ref(x, p):
    v = x[0]
    axis = p["axis"] % v.ndim
    work = np.flip(v, axis) if p["reverse"] else v
    acc = np.cumprod(work.astype(np.float64) if v.dtype == np.float32 else work, axis=axis)
    if p["exclusive"]:  # shifted by one: 1 first, then the products before each element
        acc = np.concatenate([np.ones_like(np.take(acc, [0], axis=axis)), np.delete(acc, -1, axis=axis)], axis=axis)
    if p["reverse"]:
        acc = np.flip(acc, axis)
    return acc.astype(v.dtype)


register(OpDef("cumprod", (1, 1), _cumsum_infer, cumprod_ref, defaults={"exclusive": False, "reverse": False},
               required=("axis",)))
