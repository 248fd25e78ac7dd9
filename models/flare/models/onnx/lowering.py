"""ONNX ops -> Flare ops: one function per ONNX op type, opset differences inside it.

A lowering is `fn(tr, node, ins, attrs) -> [Val, ...]`: `tr` is the Tracer
(`tr.t(v)` a value as a Flare tensor, `tr.c(v)` its value on the host —
closing the segment when it is computed — `tr.op(...)` a Flare node,
`tr.val(tensor, shape, dtype)` the ONNX value it holds, `tr.opset` the
model's default-domain opset). `ins` has None for omitted optional inputs.
Constant-only nodes never get here: `fold` evaluates them with onnx's own
reference kernels. `HOST_STEPS` are the ops whose *output shape* depends on
data (NonZero): they run on the host between segments.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .errors import OnnxError
from .values import BOOL, MAX_RANK, Val, flare_shape, is_wide

F32 = np.dtype(np.float32)
I64 = np.dtype(np.int64)
I32 = np.dtype(np.int32)
INTS = (I32, I64)
Lowering = Callable[..., list]
LOWERINGS: dict[str, Lowering] = {}
# ops that take *wide* values (rank > 4, held contiguously in a merged Flare shape: values.flare_shape)
WIDE_OK = {"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Identity", "Shape", "Size", "Dropout",
           "BatchNormalization", "GatherND", "ScatterND",  # these two take wide *index* tensors
           "Concat", "GatherElements", "Slice", "Transpose", *("ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 "
                                                   "ReduceL2 ReduceSumSquare ReduceLogSum ReduceLogSumExp").split()}
HOST_STEPS: dict[str, Callable[..., list]] = {}


def lowers(*names: str):
    def deco(fn):
        for n in names:
            LOWERINGS[n] = fn
        return fn
    return deco


def attributes(node: Any) -> dict[str, Any]:
    from onnx import helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        out[a.name] = v
    return out


def fold(tr: Any, node: Any, ins: list) -> list:
    """Evaluate a node of constants on the host with onnx.reference (the file's own semantics)."""
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.ops import load_op

    try:
        cls = load_op(node.domain, node.op_type, tr.opset if node.domain in ("", "ai.onnx") else None)
        run_params = {"log": lambda *a: None, "opsets": {"": tr.opset}, "verbose": 0, "new_ops": None,
                      "existing_functions": {}, "evaluator_cls": ReferenceEvaluator}
        op = cls(node, run_params)
        res = op.run(*[None if v is None else v.const for v in ins])
    except OnnxError:
        raise
    except Exception as exc:
        raise OnnxError(f"cannot evaluate on constants: {type(exc).__name__}: {exc}") from None
    if not isinstance(res, tuple):
        res = (res,)
    out = []
    for r in res:
        arr = np.asarray(r)
        out.append(Val("", tuple(arr.shape), arr.dtype, const=arr))
    return out


def cval(shape_or_arr, dtype=None) -> Val:
    arr = np.asarray(shape_or_arr, dtype=dtype)
    return Val("", tuple(arr.shape), arr.dtype, const=arr)


def _need(v: Val | None, what: str, dtypes=(F32,)) -> Val:
    if v is None:
        raise OnnxError(f"{what} is missing")
    if np.dtype(v.dtype) not in [np.dtype(d) for d in dtypes]:
        raise OnnxError(f"{what} has dtype {np.dtype(v.dtype).name}; supported: {', '.join(np.dtype(d).name for d in dtypes)}")
    return v


def _ints(tr, v: Val | None) -> list[int] | None:
    return None if v is None else [int(x) for x in np.asarray(tr.c(v)).reshape(-1)]


def _full(tr, value, dtype) -> Any:
    """A scalar constant as a (1,) tensor (broadcasts like a scalar)."""
    return tr.t(cval(np.array(value, dtype=dtype)))


def _bshape(*vals: Val) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*[v.shape for v in vals]))
    except ValueError:
        raise OnnxError(f"shapes {' and '.join(str(v.shape) for v in vals)} do not broadcast") from None


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


def _fd(dtype) -> str:
    return {F32: "f32", I32: "i32", I64: "i64", BOOL: "i32"}[np.dtype(dtype)]


@lowers("Identity")
def _identity(tr, node, ins, attrs):
    x = ins[0]
    return [Val("", x.shape, x.dtype, const=x.const, tensor=x.tensor, runtime=x.runtime, fixed=x.fixed)]


@lowers("Dropout")
def _dropout(tr, node, ins, attrs):
    out = _identity(tr, node, ins, attrs)
    if len(node.output) > 1 and node.output[1]:
        out.append(cval(np.ones(ins[0].shape, dtype=bool)))
    return out


def _where_pos(tr, x, pos, neg, strict=True):
    """where(x > 0, pos, neg) (or x >= 0) over f32 tensors."""
    zero = _full(tr, 0.0, np.float32)
    cond = tr.op("greater" if strict else "greater_equal", x, zero)
    return tr.op("where", cond, pos, neg)


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
        out = _where_pos(tr, t, t, tr.op("scale", t, scale=float(attrs.get("alpha", 0.01))), strict=False)
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
    from .values import np_dtype_of

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


# -- matrix products ------------------------------------------------------------------
@lowers("MatMul")
def _matmul(tr, node, ins, attrs):
    a, b = _need(ins[0], "A"), _need(ins[1], "B")
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


# -- softmax and reductions ---------------------------------------------------------
def _axis(axis: int, rank: int) -> int:
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise OnnxError(f"axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def _last_axis_apply(tr, t, rank, axis, fn):
    """Apply fn over the last axis, permuting `axis` there and back."""
    if axis == rank - 1:
        return fn(t)
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    return tr.op("permute", fn(tr.op("contiguous", tr.op("permute", t, axes=perm))), axes=perm)


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


def _reduce_chain(tr, t, shape, axes, keep, op):
    rank = len(shape)
    axes = sorted({_axis(a, rank) for a in (range(rank) if axes is None else axes)}, reverse=True)
    for a in axes:
        t = tr.op(op, t, axis=a, keepdims=True)
    out_shape = tuple(1 if i in axes else d for i, d in enumerate(shape)) if keep else \
        tuple(d for i, d in enumerate(shape) if i not in axes)
    return t, out_shape


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


@lowers("CumSum")
def _cumsum(tr, node, ins, attrs):
    x = ins[0]
    axis = _axis(_ints(tr, ins[1])[0], len(x.shape))
    out = tr.op("cumsum", tr.t(x), axis=axis, exclusive=bool(attrs.get("exclusive", 0)),
                reverse=bool(attrs.get("reverse", 0)))
    return [tr.val(out, x.shape, x.dtype)]


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
    from .values import np_dtype_of

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


def _reshape_to(tr, x: Val, shape: tuple[int, ...]) -> list:
    if x.is_const and not x.runtime:
        return [cval(np.asarray(x.const).reshape(shape))]
    return [tr.val(tr.op("reshape", tr.t(x), shape=list(flare_shape(shape))), shape, x.dtype)]


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
            raise OnnxError(f"transpose {perm} of {x.shape} needs rank {len(src)} even with axes merged")
        t = tr.op("reshape", tr.t(x), shape=list(src))
        return [tr.val(tr.op("contiguous", tr.op("permute", t, axes=merged_perm)), out_shape, x.dtype)]
    out = tr.op("permute", tr.t(x), axes=perm)
    return [tr.val(out, out_shape, x.dtype)]


def merged_permutation(shape, perm) -> tuple[tuple[int, ...], list[int]]:
    """A wide transpose in fewer axes: size-1 axes dropped, and source axes that stay
    neighbours, in order, in the output merged. Returns (merged source shape, its permutation)."""
    keep = [p for p in perm if shape[p] != 1]
    groups: list[list[int]] = []
    for p in keep:
        if groups and groups[-1][-1] + 1 == p or (groups and all(shape[q] == 1 for q in range(groups[-1][-1] + 1, p))
                                                  and groups[-1][-1] < p):
            groups[-1].append(p)
        else:
            groups.append([p])
    order = sorted(range(len(groups)), key=lambda g: groups[g][0])  # groups in source order
    src = tuple(int(np.prod([shape[a] for a in groups[g]], dtype=np.int64)) for g in order)
    position = {g: i for i, g in enumerate(order)}
    return src or (1,), [position[g] for g in range(len(groups))] or [0]


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


def _slice_axis(tr, t, shape, axis, start, stop, step):
    """One ONNX-clamped slice of one axis; a negative step flips first."""
    dim = shape[axis]
    idx = range(*slice(start, stop, step).indices(dim))
    n = len(idx)
    if n == 0:
        raise OnnxError(f"slice of axis {axis} is empty (zero-size tensors are not supported)")
    if step < 0:
        t = tr.op("flip", t, axis=axis)
        first = dim - 1 - idx[0]
        step = -step
    else:
        first = idx[0]
    if first == 0 and step == 1 and n == dim:
        return t, n
    return tr.op("slice", t, axis=axis, start=first, stop=first + (n - 1) * step + 1, step=step), n


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


def _indices(tr, v: Val):
    t = tr.t(v)
    return t


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


def merged_broadcast(src: tuple[int, ...], out: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Merge neighbouring axes that broadcast alike (both kept, or both repeated) so a wide
    broadcast fits in fewer axes; size-1 output axes merge with anything."""
    groups: list[list[int]] = []  # [src size, out size, status]
    for s, o in zip(src, out):
        if o == 1:
            continue
        status = "k" if s == o else "b"
        if groups and groups[-1][2] == status:
            groups[-1][0] *= s
            groups[-1][1] *= o
        else:
            groups.append([s, o, status])
    if not groups:
        return (1,), (1,)
    return tuple(g[0] for g in groups), tuple(g[1] for g in groups)


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
    if mode not in ("constant", "reflect", "edge"):
        raise OnnxError(f"pad mode {mode!r} is not supported (constant, reflect, edge)")
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
    elif any(lo or hi for lo, hi in pairs):
        t = tr.op("pad", t, pads=pairs, mode=mode, value=value)
        shape = [d + lo + hi for d, (lo, hi) in zip(shape, pairs)]
    else:
        t = tr.op("contiguous", t)
    return [tr.val(t, tuple(shape), x.dtype)]


@lowers("Trilu")
def _trilu(tr, node, ins, attrs):
    x = ins[0]
    k = _ints(tr, ins[1])[0] if len(ins) > 1 and ins[1] is not None else 0
    n, m = x.shape[-2:]
    mask = np.tril(np.ones((n, m), bool), k) if not attrs.get("upper", 1) else np.triu(np.ones((n, m), bool), k)
    zero = _full(tr, 0, x.dtype if x.dtype != BOOL else np.int32)
    out = tr.op("where", tr.t(cval(mask)), tr.t(x), zero)
    return [tr.val(out, x.shape, x.dtype)]


@lowers("TopK")
def _topk(tr, node, ins, attrs):
    x = _need(ins[0], "X")
    k = _ints(tr, ins[1])[0] if tr.opset >= 10 else int(attrs["k"])
    rank = len(x.shape)
    axis = _axis(attrs.get("axis", -1), rank)
    t = tr.t(x)
    if axis != rank - 1:
        perm = list(range(rank))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        t = tr.op("contiguous", tr.op("permute", t, axes=perm))
    src = t if attrs.get("largest", 1) else tr.op("neg", t)
    idx = tr.op("top_k", src, k=k)
    vals = tr.op("take_along_axis", t, idx, axis=-1)
    if axis != rank - 1:
        vals = tr.op("permute", vals, axes=perm)
        idx = tr.op("permute", idx, axes=perm)
    shape = tuple(k if i == axis else d for i, d in enumerate(x.shape))
    return [tr.val(tr.op("contiguous", vals), shape, F32), tr.val(tr.op("cast", idx, dtype="i64"), shape, I64)]


# -- convolution, pooling, normalization -------------------------------------------------
def _spatial_pads(attrs, in_hw, kernel, strides, dilations, ceil_mode=False):
    nd = len(in_hw)
    auto = attrs.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * nd)
        for i in range(nd):
            out = -(-in_hw[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - in_hw[i])
            small, big = total // 2, total - total // 2
            pads[i], pads[i + nd] = (small, big) if auto == "SAME_UPPER" else (big, small)
        return pads
    if auto == "VALID":
        return [0] * (2 * nd)
    return list(attrs.get("pads", [0] * (2 * nd)))


def _as_2d(tr, x: Val):
    """[N, C, L] -> [N, C, 1, L] so 1-D convs and pools run as 2-D."""
    t = tr.t(x)
    if len(x.shape) == 3:
        t = tr.op("reshape", t, shape=[x.shape[0], x.shape[1], 1, x.shape[2]])
    elif len(x.shape) != 4:
        raise OnnxError(f"{len(x.shape) - 2}-D spatial input {x.shape} (1-D and 2-D are supported)")
    return t


def _pairs(values, nd, fill):
    values = list(values)
    return [fill] * (2 - nd) + values if nd < 2 else values


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
    out = tr.op("conv2d", t, tw, strides=_pairs(strides, nd, 1), dilations=_pairs(dil, nd, 1), pads=pp,
                groups=int(attrs.get("group", 1)))
    if len(ins) > 2 and ins[2] is not None:
        out = tr.op("add", out, tr.op("reshape", tr.t(ins[2]), shape=[ins[2].shape[0], 1, 1]))
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


def _channel_vec(tr, v: Val, rank: int):
    """A per-channel [C] value shaped [C, 1, ...] to broadcast over [N, C, ...]."""
    return tr.op("reshape", tr.t(v), shape=[v.shape[0]] + [1] * (rank - 2))


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


def _norm_tail(tr, x, flat_shape, norm_op, eps, shape_after):
    t = tr.op("reshape", tr.t(x), shape=flat_shape)
    return tr.op("reshape", tr.op(norm_op, t, eps=eps), shape=shape_after)


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


# -- host steps: output shapes that depend on data ---------------------------------------
def _host(tr, node, ins):
    """Read the inputs back (closing the segment), run the op on the host, feed the results onwards."""
    for v in ins:
        if v is not None:
            tr.c(v)
    outs = fold(tr, node, ins)
    for v in outs:
        v.runtime = True
    tr.runner.stats["host_steps"] += 1
    return outs


for _op in ("NonZero", "Unique", "Compress"):
    HOST_STEPS[_op] = _host


@lowers("If")
def _if(tr, node, ins, attrs):
    """The branch the condition picks, inlined (the condition is read on the host when computed)."""
    cond = bool(np.asarray(tr.c(ins[0])).reshape(-1)[0])
    return tr.run_branch(attrs["then_branch" if cond else "else_branch"])


# elementwise ops: they take wide values whose operands share one shape (runner._same_shape_elementwise)
ELEMENTWISE = set(_ARITH) | set(_COMPARE) | set(_UNARY) | {"Pow", "Mod", "Where", "Not", "IsNaN", "Cast", "CastLike",
                                                            "Clip", "Min", "Max", "Sum", "Mean"}


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


for _op in ("NonMaxSuppression",):  # its output length is the number of boxes kept: data-dependent
    HOST_STEPS[_op] = _host


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


def _zero_upsample(tr, t, axis: int, size: int, stride: int):
    """Insert stride-1 zeros between the elements of one axis: move it last, pad a new unit axis
    with zeros to `stride`, flatten the two, and cut the trailing zeros."""
    if stride == 1:
        return t, size
    shape = list(t.shape)
    rank = len(shape)
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    moved = tr.op("contiguous", tr.op("permute", t, axes=perm)) if axis != rank - 1 else t
    moved_shape = [shape[p] for p in perm]
    rows = int(np.prod(moved_shape[:-1], dtype=np.int64))
    u = tr.op("reshape", moved, shape=[rows, size, 1])
    u = tr.op("pad", u, pads=[[0, 0], [0, 0], [0, stride - 1]])
    out = (size - 1) * stride + 1
    u = tr.op("slice", tr.op("reshape", u, shape=[rows, size * stride]), axis=1, start=0, stop=out)
    u = tr.op("reshape", tr.op("contiguous", u), shape=moved_shape[:-1] + [out])
    return (tr.op("permute", u, axes=perm) if axis != rank - 1 else u), out


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


_LSTM_GATES = [0, 2, 3, 1]  # ONNX blocks i, o, f, c -> Flare's (PyTorch's) i, f, g(c), o


@lowers("LSTM")
def _lstm(tr, node, ins, attrs):
    """ONNX LSTM onto Flare's `lstm` recurrence: gates reordered, the input projection (plus
    both biases) one matmul, reverse directions on a flipped sequence. Default activations,
    no peepholes, no clip, full-length sequences."""
    x, w, r = (_need(v, n) for v, n in zip(ins[:3], ("X", "W", "R")))

    def opt(i):
        return ins[i] if len(ins) > i and ins[i] is not None else None

    b, seq_lens, h0, c0, peep = opt(3), opt(4), opt(5), opt(6), opt(7)
    if attrs.get("activations") not in (None, [b"Sigmoid", b"Tanh", b"Tanh"], ["Sigmoid", "Tanh", "Tanh"]):
        raise OnnxError(f"LSTM activations {attrs['activations']} (only the defaults)")
    if "clip" in attrs or attrs.get("input_forget", 0):
        raise OnnxError("LSTM clip / input_forget are not supported")
    if peep is not None and np.any(tr.c(peep)):
        raise OnnxError("LSTM peepholes are not supported")
    layout = int(attrs.get("layout", 0))
    t = tr.t(x)
    if layout:
        t = tr.op("contiguous", tr.op("permute", t, axes=[1, 0, 2]))
    steps, batch = (x.shape[1], x.shape[0]) if layout else (x.shape[0], x.shape[1])
    if seq_lens is not None and np.any(np.asarray(tr.c(seq_lens)) != steps):
        raise OnnxError("LSTM sequence_lens shorter than the sequence are not supported")
    direction = attrs.get("direction", "forward")
    dirs = 2 if direction == "bidirectional" else 1
    hidden = r.shape[-1]
    wv, rv = np.asarray(tr.c(w), np.float32), np.asarray(tr.c(r), np.float32)
    bv = np.asarray(tr.c(b), np.float32) if b is not None else np.zeros((dirs, 8 * hidden), np.float32)

    def gates(m):
        return np.concatenate([m[k * hidden:(k + 1) * hidden] for k in _LSTM_GATES], axis=0)

    def state(v, d):
        if v is None:
            return tr.t(cval(np.zeros((batch, hidden), np.float32)))
        s = tr.t(v)
        if layout:
            s = tr.op("contiguous", tr.op("permute", s, axes=[1, 0, 2]))
        return tr.op("contiguous", tr.op("reshape", tr.op("slice", s, axis=0, start=d, stop=d + 1),
                                         shape=[batch, hidden]))

    ys, hs, cs = [], [], []
    for d in range(dirs):
        reverse = direction == "reverse" or d == 1
        seq = tr.op("flip", t, axis=0) if reverse else t
        proj = tr.op("matmul", seq, tr.t(cval(gates(wv[d]))), transpose_b=True)
        proj = tr.op("add", proj, tr.t(cval(gates(bv[d, :4 * hidden]) + gates(bv[d, 4 * hidden:]))))
        out = tr.op("lstm", proj, tr.t(cval(gates(rv[d]))), state(h0, d), state(c0, d))  # [T, B, 2H]
        y = tr.op("slice", out, axis=2, start=0, stop=hidden)
        last_h = tr.op("slice", y, axis=0, start=steps - 1, stop=steps)
        last_c = tr.op("slice", tr.op("slice", out, axis=2, start=hidden, stop=2 * hidden), axis=0,
                       start=steps - 1, stop=steps)
        if reverse:
            y = tr.op("flip", y, axis=0)
        ys.append(tr.op("reshape", tr.op("contiguous", y), shape=[steps, 1, batch, hidden]))
        hs.append(tr.op("contiguous", last_h))
        cs.append(tr.op("contiguous", last_c))
    y = ys[0] if dirs == 1 else tr.op("concat", ys[0], ys[1], axis=1)
    yh = hs[0] if dirs == 1 else tr.op("concat", hs[0], hs[1], axis=0)
    yc = cs[0] if dirs == 1 else tr.op("concat", cs[0], cs[1], axis=0)
    if layout:
        return [tr.val(tr.op("contiguous", tr.op("permute", y, axes=[2, 0, 1, 3])), (batch, steps, dirs, hidden), F32),
                tr.val(tr.op("contiguous", tr.op("permute", yh, axes=[1, 0, 2])), (batch, dirs, hidden), F32),
                tr.val(tr.op("contiguous", tr.op("permute", yc, axes=[1, 0, 2])), (batch, dirs, hidden), F32)]
    return [tr.val(y, (steps, dirs, batch, hidden), F32), tr.val(yh, (dirs, batch, hidden), F32),
            tr.val(yc, (dirs, batch, hidden), F32)]


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


def _random_like(tr, node, ins):
    """RandomNormalLike / RandomUniformLike: drawn on the host (seeded by the node's `seed` when it has one)."""
    attrs = attributes(node)
    x = ins[0]
    from .values import np_dtype_of

    dtype = np_dtype_of(attrs["dtype"], "dtype") if "dtype" in attrs else x.dtype
    rng = np.random.default_rng(int(attrs["seed"]) if "seed" in attrs else None)
    if node.op_type == "RandomNormalLike":
        arr = rng.normal(attrs.get("mean", 0.0), attrs.get("scale", 1.0), x.shape)
    else:
        arr = rng.uniform(attrs.get("low", 0.0), attrs.get("high", 1.0), x.shape)
    v = cval(arr.astype(dtype))
    v.runtime = True  # a fresh draw per call: an input of the next segment, never a cached weight
    return [v]


HOST_STEPS["RandomNormalLike"] = _random_like
HOST_STEPS["RandomUniformLike"] = _random_like


@lowers("ScatterElements", "Scatter")
def _scatter_elements(tr, node, ins, attrs):
    x, idx, upd = ins
    axis = _axis(attrs.get("axis", 0), len(x.shape))
    out = tr.op("scatter_elements", tr.t(x), tr.t(idx), tr.t(upd), axis=axis, mode=attrs.get("reduction", "none"))
    return [tr.val(out, x.shape, x.dtype)]


@lowers("CumProd")
def _cumprod(tr, node, ins, attrs):
    x = ins[0]
    axis = _axis(_ints(tr, ins[1])[0], len(x.shape))
    out = tr.op("cumprod", tr.t(x), axis=axis, exclusive=bool(attrs.get("exclusive", 0)),
                reverse=bool(attrs.get("reverse", 0)))
    return [tr.val(out, x.shape, x.dtype)]


@lowers("RNN", "GRU")
def _rnn_unrolled(tr, node, ins, attrs):
    """ONNX RNN and GRU unrolled over the (bound) sequence length: per step one matmul with the
    recurrent weights and the gate math as elementwise ops. Default activations, no clip,
    full-length sequences; reverse and bidirectional run the steps backwards."""
    x, w, r = (_need(v, n) for v, n in zip(ins[:3], ("X", "W", "R")))

    def opt(i):
        return ins[i] if len(ins) > i and ins[i] is not None else None

    b, seq_lens, h0 = opt(3), opt(4), opt(5)
    gru = node.op_type == "GRU"
    if attrs.get("activations") is not None or "clip" in attrs:
        raise OnnxError(f"{node.op_type} activations/clip other than the defaults")
    layout = int(attrs.get("layout", 0))
    t = tr.t(x)
    if layout:
        t = tr.op("contiguous", tr.op("permute", t, axes=[1, 0, 2]))
    steps, batch = (x.shape[1], x.shape[0]) if layout else (x.shape[0], x.shape[1])
    if seq_lens is not None and np.any(np.asarray(tr.c(seq_lens)) != steps):
        raise OnnxError(f"{node.op_type} sequence_lens shorter than the sequence are not supported")
    direction = attrs.get("direction", "forward")
    dirs = 2 if direction == "bidirectional" else 1
    hidden = r.shape[-1]
    gates = 3 if gru else 1
    wv, rv = np.asarray(tr.c(w), np.float32), np.asarray(tr.c(r), np.float32)
    bv = np.asarray(tr.c(b), np.float32) if b is not None else np.zeros((dirs, 2 * gates * hidden), np.float32)
    lbr = int(attrs.get("linear_before_reset", 0))
    ys, hs = [], []
    for d in range(dirs):
        reverse = direction == "reverse" or d == 1
        proj = tr.op("add", tr.op("matmul", t, tr.t(cval(wv[d])), transpose_b=True),
                     tr.t(cval(bv[d, :gates * hidden])))                      # [T, B, G*H]
        rb = bv[d, gates * hidden:]
        if h0 is None:
            h = tr.t(cval(np.zeros((batch, hidden), np.float32)))
        else:
            hsrc = tr.t(h0)
            if layout:
                hsrc = tr.op("contiguous", tr.op("permute", hsrc, axes=[1, 0, 2]))
            h = tr.op("reshape", tr.op("contiguous", tr.op("slice", hsrc, axis=0, start=d, stop=d + 1)),
                      shape=[batch, hidden])
        outs = [None] * steps
        for step in (range(steps - 1, -1, -1) if reverse else range(steps)):
            xt = tr.op("reshape", tr.op("contiguous", tr.op("slice", proj, axis=0, start=step, stop=step + 1)),
                       shape=[batch, gates * hidden])
            if not gru:
                hr = tr.op("add", tr.op("matmul", h, tr.t(cval(rv[d])), transpose_b=True), tr.t(cval(rb)))
                h = tr.op("tanh", tr.op("add", xt, hr))
            else:
                def part(v, k):
                    return tr.op("slice", v, axis=1, start=k * hidden, stop=(k + 1) * hidden)

                rz = tr.op("add", tr.op("matmul", h, tr.t(cval(rv[d][:2 * hidden])), transpose_b=True),
                           tr.t(cval(rb[:2 * hidden])))
                z = tr.op("sigmoid", tr.op("add", part(xt, 0), part(rz, 0)))
                rr = tr.op("sigmoid", tr.op("add", part(xt, 1), part(rz, 1)))
                rh_w, rh_b = tr.t(cval(rv[d][2 * hidden:])), tr.t(cval(rb[2 * hidden:]))
                if lbr:
                    hh = tr.op("mul", rr, tr.op("add", tr.op("matmul", h, rh_w, transpose_b=True), rh_b))
                else:
                    hh = tr.op("add", tr.op("matmul", tr.op("mul", rr, h), rh_w, transpose_b=True), rh_b)
                n = tr.op("tanh", tr.op("add", part(xt, 2), hh))
                h = tr.op("add", n, tr.op("mul", z, tr.op("sub", h, n)))   # (1 - z) n + z h
            outs[step] = h
        y = tr.op("reshape", outs[0], shape=[1, batch, hidden])
        for o in outs[1:]:
            y = tr.op("concat", y, tr.op("reshape", o, shape=[1, batch, hidden]), axis=0)
        ys.append(tr.op("reshape", tr.op("contiguous", y), shape=[steps, 1, batch, hidden]))
        hs.append(tr.op("reshape", outs[0 if reverse else steps - 1], shape=[1, batch, hidden]))
    y = ys[0] if dirs == 1 else tr.op("concat", ys[0], ys[1], axis=1)
    yh = hs[0] if dirs == 1 else tr.op("concat", hs[0], hs[1], axis=0)
    if layout:
        return [tr.val(tr.op("contiguous", tr.op("permute", y, axes=[2, 0, 1, 3])), (batch, steps, dirs, hidden), F32),
                tr.val(tr.op("contiguous", tr.op("permute", yh, axes=[1, 0, 2])), (batch, dirs, hidden), F32)]
    return [tr.val(y, (steps, dirs, batch, hidden), F32), tr.val(tr.op("contiguous", yh), (dirs, batch, hidden), F32)]
