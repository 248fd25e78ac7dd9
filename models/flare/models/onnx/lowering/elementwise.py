"""Elementwise ONNX ops: arithmetic, comparisons, logic, unary math, activations, Clip, Cast."""
from __future__ import annotations

import math

import numpy as np

from ..errors import OnnxError
from ..values import BOOL, flare_shape, is_wide
from .base import F32, I32, I64, INTS, _bshape, _fd, _full, _identity, _need, _where_pos, cval, lowers


# -- elementwise --------------------------------------------------------------------
_ARITH = {"Add": ("add", "int_add"), "Sub": ("sub", "int_sub"), "Mul": ("mul", "int_mul"), "Div": ("div", "int_div")}


@lowers(*_ARITH)
def _arith(tr, node, ins, attrs):
    a, b = ins
    if a.dtype != b.dtype:
        raise OnnxError(f"inputs have dtypes {a.dtype} and {b.dtype}")
    fop, iop = _ARITH[node.op_type]
    if a.dtype == F32:
        op = fop
    elif a.dtype in INTS:
        op = iop
    else:
        raise OnnxError(f"dtype {a.dtype} is not supported")
    return [tr.val(tr.op(op, tr.t(a), tr.t(b)), _bshape(a, b), a.dtype)]


@lowers("Pow")
def _pow(tr, node, ins, attrs):
    a, b = ins
    _need(a, "base")
    e = tr.t(b) if b.dtype == F32 else tr.op("cast", tr.t(b), dtype="f32")
    return [tr.val(tr.op("pow", tr.t(a), e), _bshape(a, b), F32)]


@lowers("Mod")
def _mod(tr, node, ins, attrs):
    a, b = ins
    return [tr.val(tr.op("mod", tr.t(a), tr.t(b), fmod=bool(attrs.get("fmod", 0))), _bshape(a, b), a.dtype)]


_VARIADIC = {"Min": "minimum", "Max": "maximum", "Sum": None, "Mean": None}


@lowers(*_VARIADIC)
def _variadic(tr, node, ins, attrs):
    vals = [v for v in ins if v is not None]
    dtype = vals[0].dtype
    op = _VARIADIC[node.op_type] or ("add" if dtype == F32 else "int_add")
    acc = tr.t(vals[0])
    if len(vals) == 1:
        acc = tr.op("contiguous", acc)
    for v in vals[1:]:
        acc = tr.op(op, acc, tr.t(v))
    if node.op_type == "Mean":
        _need(vals[0], "Mean input")
        acc = tr.op("scale", acc, scale=1.0 / len(vals))
    return [tr.val(acc, _bshape(*vals), dtype)]


_COMPARE = {"Equal": "equal", "Less": "less", "LessOrEqual": "less_equal", "Greater": "greater",
            "GreaterOrEqual": "greater_equal", "And": "logical_and", "Or": "logical_or", "Xor": "logical_xor"}


@lowers(*_COMPARE)
def _compare(tr, node, ins, attrs):
    a, b = ins
    if a.dtype != b.dtype:
        raise OnnxError(f"inputs have dtypes {a.dtype} and {b.dtype}")
    return [tr.val(tr.op(_COMPARE[node.op_type], tr.t(a), tr.t(b)), _bshape(a, b), BOOL)]


@lowers("Not")
def _not(tr, node, ins, attrs):
    return [tr.val(tr.op("logical_not", tr.t(ins[0])), ins[0].shape, BOOL)]


@lowers("IsNaN")
def _isnan(tr, node, ins, attrs):
    return [tr.val(tr.op("isnan", tr.t(_need(ins[0], "X"))), ins[0].shape, BOOL)]


@lowers("Where")
def _where(tr, node, ins, attrs):
    c, a, b = ins
    if a.dtype != b.dtype:
        raise OnnxError(f"branches have dtypes {a.dtype} and {b.dtype}")
    return [tr.val(tr.op("where", tr.t(c), tr.t(a), tr.t(b)), _bshape(c, a, b), a.dtype)]


_UNARY = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Exp": "exp", "Sqrt": "sqrt", "Neg": "neg",
          "Abs": "abs", "Log": "log", "Ceil": "ceil", "Floor": "floor", "Round": "round", "Sign": "sign",
          "Reciprocal": "reciprocal", "Sin": "sin", "Cos": "cos", "Tan": "tan", "Asin": "asin", "Acos": "acos",
          "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh", "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh",
          "Erf": "erf", "Softplus": "softplus", "Softsign": "softsign"}


@lowers(*_UNARY)
def _unary(tr, node, ins, attrs):
    x = ins[0]
    if x.dtype in INTS and node.op_type in ("Neg", "Abs", "Relu", "Sign"):
        zero = _full(tr, 0, x.dtype)
        t = tr.t(x)
        if node.op_type == "Neg":
            out = tr.op("int_sub", zero, t)
        elif node.op_type == "Relu":
            out = tr.op("maximum", t, zero)
        elif node.op_type == "Abs":
            out = tr.op("maximum", t, tr.op("int_sub", zero, t))
        else:
            pos = tr.op("cast", tr.op("greater", t, zero), dtype=_fd(x.dtype))
            neg = tr.op("cast", tr.op("less", t, zero), dtype=_fd(x.dtype))
            out = tr.op("int_sub", pos, neg)
        return [tr.val(out, x.shape, x.dtype)]
    _need(x, "X")
    return [tr.val(tr.op(_UNARY[node.op_type], tr.t(x)), x.shape, F32)]


@lowers("Dropout")
def _dropout(tr, node, ins, attrs):
    out = _identity(tr, node, ins, attrs)
    if len(node.output) > 1 and node.output[1]:
        out.append(cval(np.ones(ins[0].shape, dtype=bool)))
    return out


@lowers("Elu", "Selu", "Celu", "LeakyRelu", "PRelu", "HardSigmoid", "HardSwish", "ThresholdedRelu", "Mish",
        "Gelu", "Swish", "Shrink")
def _activation(tr, node, ins, attrs):
    x = _need(ins[0], "X")
    t = tr.t(x)
    kind = node.op_type
    if kind in ("Elu", "Selu"):
        alpha = attrs.get("alpha", 1.0 if kind == "Elu" else 1.67326319217681884765625)
        neg = tr.op("scale", tr.op("scale", tr.op("exp", t), scale=1.0, bias=-1.0), scale=float(alpha))
        out = _where_pos(tr, t, t, neg)
        if kind == "Selu":
            out = tr.op("scale", out, scale=float(attrs.get("gamma", 1.05070102214813232421875)))
    elif kind == "Celu":
        alpha = float(attrs.get("alpha", 1.0))
        em1 = tr.op("scale", tr.op("exp", tr.op("scale", t, scale=1.0 / alpha)), scale=alpha, bias=-alpha)
        out = tr.op("add", tr.op("relu", t), tr.op("clamp", em1, hi=0.0))
    elif kind == "LeakyRelu":
        # alpha*x + (1 - alpha)*relu(x): ops every backend runs natively (a comparison and `where` are
        # NumPy kernels on the CPU and CPU-only elsewhere; audio decoders apply this to every layer)
        alpha = float(attrs.get("alpha", 0.01))
        out = tr.op("add", tr.op("scale", t, scale=alpha), tr.op("scale", tr.op("relu", t), scale=1.0 - alpha))
    elif kind == "PRelu":
        sv = _need(ins[1], "slope")
        slope = tr.t(sv)
        try:
            out_shape = _bshape(x, sv)
        except OnnxError:  # a per-channel [C] slope over [N, C, ...] (as PyTorch exports it)
            if len(sv.shape) != 1 or len(x.shape) < 2 or sv.shape[0] != x.shape[1]:
                raise
            slope = tr.op("reshape", slope, shape=[sv.shape[0]] + [1] * (len(flare_shape(x.shape)) - 2))
            out_shape = x.shape
        if is_wide(x.shape):
            raise OnnxError(f"PRelu of a rank-{len(x.shape)} input")
        out = _where_pos(tr, t, t, tr.op("mul", t, slope), strict=False)
        if tuple(out.shape) != flare_shape(out_shape):
            out = tr.op("expand", out, shape=list(flare_shape(out_shape)))
        return [tr.val(out, out_shape, F32)]
    elif kind in ("HardSigmoid", "HardSwish"):
        alpha = float(attrs.get("alpha", 0.2)) if kind == "HardSigmoid" else 1.0 / 6.0
        beta = float(attrs.get("beta", 0.5)) if kind == "HardSigmoid" else 0.5
        out = tr.op("clamp", tr.op("scale", t, scale=alpha, bias=beta), lo=0.0, hi=1.0)
        if kind == "HardSwish":
            out = tr.op("mul", t, out)
    elif kind == "ThresholdedRelu":
        alpha = float(attrs.get("alpha", 1.0))
        cond = tr.op("greater", t, _full(tr, alpha, np.float32))
        out = tr.op("where", cond, t, _full(tr, 0.0, np.float32))
    elif kind == "Mish":
        out = tr.op("mul", t, tr.op("tanh", tr.op("softplus", t)))
    elif kind == "Swish":
        out = tr.op("mul", t, tr.op("sigmoid", tr.op("scale", t, scale=float(attrs.get("alpha", 1.0)))))
    elif kind == "Shrink":
        lambd, bias = float(attrs.get("lambd", 0.5)), float(attrs.get("bias", 0.0))
        lo = tr.op("less", t, _full(tr, -lambd, np.float32))
        hi = tr.op("greater", t, _full(tr, lambd, np.float32))
        zero = _full(tr, 0.0, np.float32)
        out = tr.op("where", hi, tr.op("scale", t, scale=1.0, bias=-bias),
                    tr.op("where", lo, tr.op("scale", t, scale=1.0, bias=bias), zero))
    else:  # Gelu
        if attrs.get("approximate", "none") == "tanh":
            cube = tr.op("mul", tr.op("sqr", t), t)
            inner = tr.op("scale", tr.op("add", t, tr.op("scale", cube, scale=0.044715)), scale=math.sqrt(2 / math.pi))
            out = tr.op("mul", tr.op("scale", t, scale=0.5), tr.op("scale", tr.op("tanh", inner), scale=1.0, bias=1.0))
        else:
            out = tr.op("gelu", t)
    return [tr.val(out, x.shape, F32)]


@lowers("Clip")
def _clip(tr, node, ins, attrs):
    x = ins[0]
    if tr.opset < 11:
        lo, hi = attrs.get("min"), attrs.get("max")
    else:
        lo = None if len(ins) < 2 or ins[1] is None else float(np.asarray(tr.c(ins[1])).reshape(-1)[0])
        hi = None if len(ins) < 3 or ins[2] is None else float(np.asarray(tr.c(ins[2])).reshape(-1)[0])
    if x.dtype == F32:
        return [tr.val(tr.op("clamp", tr.t(x), lo=lo, hi=hi), x.shape, F32)]
    out = tr.t(x)
    if lo is not None:
        out = tr.op("maximum", out, _full(tr, int(lo), x.dtype))
    if hi is not None:
        out = tr.op("minimum", out, _full(tr, int(hi), x.dtype))
    if lo is None and hi is None:
        out = tr.op("contiguous", out)
    return [tr.val(out, x.shape, x.dtype)]


@lowers("Cast", "CastLike")
def _cast(tr, node, ins, attrs):
    from ..values import np_dtype_of

    x = ins[0]
    to = ins[1].dtype if node.op_type == "CastLike" else np_dtype_of(attrs["to"], "Cast.to")
    to = np.dtype(to)
    if to not in (F32, I32, I64, BOOL):
        raise OnnxError(f"cast to {to.name} is not supported")
    t = tr.t(x)
    if to == BOOL:
        zero = _full(tr, 0, x.dtype if x.dtype != BOOL else np.int32)
        out = tr.op("logical_not", tr.op("equal", t, zero))
    elif _fd(to) == _fd(x.dtype):
        out = tr.op("contiguous", t)
    else:
        out = tr.op("cast", t, dtype=_fd(to))
    return [tr.val(out, x.shape, to)]


# elementwise ops: they take wide values whose operands share one shape (runner._same_shape_elementwise)
ELEMENTWISE = set(_ARITH) | set(_COMPARE) | set(_UNARY) | {"Pow", "Mod", "Where", "Not", "IsNaN", "Cast", "CastLike",
                                                            "Clip", "Min", "Max", "Sum", "Mean"}


@lowers("IsInf")
def _isinf(tr, node, ins, attrs):
    x = _need(ins[0], "X")
    t = tr.t(x)
    pos = tr.op("equal", t, _full(tr, np.inf, np.float32))
    neg = tr.op("equal", t, _full(tr, -np.inf, np.float32))
    if not attrs.get("detect_positive", 1):
        out = neg
    elif not attrs.get("detect_negative", 1):
        out = pos
    else:
        out = tr.op("logical_or", pos, neg)
    return [tr.val(out, x.shape, BOOL)]
