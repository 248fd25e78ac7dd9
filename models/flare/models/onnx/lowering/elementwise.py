"""Elementwise ONNX ops: arithmetic, comparisons, logic, unary math, activations, Clip, Cast."""
from __future__ import annotations

import math

import numpy as np

from ..errors import OnnxError
from ..values import BOOL, Val, flare_shape, is_wide
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
    shape = _bshape(a, b)
    simpler = _uniform_operand(node.op_type, a, b, shape)
    if simpler is not None:
        if isinstance(simpler, Val):
            return [simpler]
        a, b = simpler
    return [tr.val(tr.op(op, tr.t(a), tr.t(b)), shape, a.dtype)]


# the neutral element of each op, and on which side it may stand: x + 0, 0 + x, x - 0, x * 1, 1 * x, x / 1
_NEUTRAL = {"Add": (0, (0, 1)), "Sub": (0, (1,)), "Mul": (1, (0, 1)), "Div": (1, (1,))}


def _uniform(v: Val):
    """The one value of a constant (not data) whose elements are all equal, else None. Cheap
    for the big ones that matter: the first and last elements are compared before all."""
    a = v.const
    if a is None or v.runtime or v.tensor is not None or not isinstance(a, np.ndarray) or a.size == 0:
        return None
    flat = a.reshape(-1)
    first = flat[0]
    if flat[-1] != first or (a.size > 1 and not (flat == first).all()):
        return None
    return first


def _uniform_operand(op_type: str, a: Val, b: Val, shape: tuple):
    """Arithmetic with a constant of one repeated value (a folded ConstantOfShape, Exp of one:
    VITS's flow adds zeros of [1, 384, T] where it has no speaker, and multiplies by exp(0)):
    the other operand itself where the constant is the op's neutral element and the shape is the
    other's (x + 0 is taken as x: -0.0 stays -0.0 where IEEE addition would give +0.0, equal
    under ==), else the constant as one element broadcast by the op. Either way no array of the
    audio length is digested and uploaded as a weight for every new length. None: no change."""
    for side, (const, other) in enumerate(((a, b), (b, a))):
        value = _uniform(const)
        if value is None or other.shape != shape or other.dtype != const.dtype:
            continue
        neutral, sides = _NEUTRAL[op_type]
        if value == neutral and side in sides:
            return Val("", other.shape, other.dtype, const=other.const, tensor=other.tensor, runtime=other.runtime,
                       fixed=other.fixed)
        if const.const.size == 1:
            return None
        small = cval(np.full((1,) * len(const.shape), value, const.const.dtype))
        return (small, b) if side == 0 else (a, small)
    return None


@lowers("Pow")
def _pow(tr, node, ins, attrs):
    a, b = ins
    if a.dtype in INTS:
        return [_int_pow(tr, a, b)]
    _need(a, "base")
    if _is_constant_two(b) and _bshape(a, b) == a.shape:
        # x ** 2 (LayerNorm's variance, as exported): one native multiply, exactly x * x as
        # powf(x, 2) rounds it, instead of a pow (a NumPy step on the CPU backend)
        x = tr.t(a)
        return [tr.val(tr.op("mul", x, x), a.shape, F32)]
    e = tr.t(b) if b.dtype == F32 else tr.op("cast", tr.t(b), dtype="f32")
    return [tr.val(tr.op("pow", tr.t(a), e), _bshape(a, b), F32)]


def _is_constant_two(v) -> bool:
    """A constant exponent of one element equal to 2 (any numeric dtype)."""
    if v.const is None or v.runtime:
        return False
    arr = np.asarray(v.const)
    return arr.size == 1 and arr.dtype.kind in "fiu" and float(arr.reshape(-1)[0]) == 2.0


def _int_pow(tr, a, b):
    """An integer base: by squaring for an integer exponent (exact, wrapping like integer
    multiplication; the exponent's bits are read on the host to bound the loop, negative ones
    give 0 as onnx's reference does for |base| > 1), through f32 and truncated for a float one."""
    fd = _fd(a.dtype)
    if b.dtype == F32:
        out = tr.op("cast", tr.op("pow", tr.op("cast", tr.t(a), dtype="f32"), tr.t(b)), dtype=fd)
        return tr.val(out, _bshape(a, b), a.dtype)
    exps = np.asarray(tr.c(b))
    if (exps < 0).any():
        raise OnnxError("integer Pow with a negative exponent is not supported")
    e = tr.t(b) if b.dtype == a.dtype else tr.op("cast", tr.t(b), dtype=fd)
    zero, one = _full(tr, 0, a.dtype), _full(tr, 1, a.dtype)
    # ones of the broadcast shape: a * 0 + e * 0 + 1
    result = tr.op("int_add", tr.op("int_add", tr.op("int_mul", tr.t(a), zero), tr.op("int_mul", e, zero)), one)
    base = tr.t(a)
    for bit in range(int(exps.max()).bit_length() if exps.size else 0):
        set_bit = tr.op("bitwise_and", tr.op("bit_shift", e, _full(tr, bit, a.dtype), mode="right"), one)
        result = tr.op("where", tr.op("equal", set_bit, one), tr.op("int_mul", result, base), result)
        base = tr.op("int_mul", base, base)
    return tr.val(result, _bshape(a, b), a.dtype)


@lowers("Mod")
def _mod(tr, node, ins, attrs):
    a, b = ins
    return [tr.val(tr.op("mod", tr.t(a), tr.t(b), fmod=bool(attrs.get("fmod", 0))), _bshape(a, b), a.dtype)]


_BITWISE = {"BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or", "BitwiseXor": "bitwise_xor"}


@lowers(*_BITWISE)
def _bitwise(tr, node, ins, attrs):
    a, b = ins
    if a.dtype != b.dtype or a.dtype not in INTS:
        raise OnnxError(f"inputs have dtypes {a.dtype} and {b.dtype}; integers of one dtype expected")
    return [tr.val(tr.op(_BITWISE[node.op_type], tr.t(a), tr.t(b)), _bshape(a, b), a.dtype)]


@lowers("BitwiseNot")
def _bitwise_not(tr, node, ins, attrs):
    x = ins[0]
    if x.dtype not in INTS:
        raise OnnxError(f"input has dtype {x.dtype}; an integer dtype expected")
    return [tr.val(tr.op("bitwise_not", tr.t(x)), x.shape, x.dtype)]


@lowers("BitShift")
def _bit_shift(tr, node, ins, attrs):
    """Shifts on the carrier (values.CARRIER): a narrow result is wrapped to its width afterwards
    (lowering.base), and uint64, carried in int64, shifts right logically."""
    a, b = ins
    if a.dtype != b.dtype or a.dtype not in INTS:
        raise OnnxError(f"inputs have dtypes {a.dtype} and {b.dtype}; integers of one dtype expected")
    direction = attrs.get("direction", "")
    if direction not in ("LEFT", "RIGHT"):
        raise OnnxError(f"direction {direction!r} is not LEFT or RIGHT")
    mode = "left" if direction == "LEFT" else \
        "right_logical" if a.carried_from == np.dtype(np.uint64) else "right"
    return [tr.val(tr.op("bit_shift", tr.t(a), tr.t(b), mode=mode), _bshape(a, b), a.dtype)]


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
    """Identity at inference; with training_mode (read on the host) each element is kept with
    probability 1 - ratio and scaled by 1 / (1 - ratio). The mask is drawn on the host by NumPy's
    RandomState, seeded by the node's `seed` when it has one (as onnx's reference draws it), and
    fed to the segment as an input: a fresh draw per call, never a cached weight."""
    training = len(ins) > 2 and ins[2] is not None and bool(np.asarray(tr.c(ins[2])).reshape(-1)[0])
    ratio = float(np.asarray(tr.c(ins[1])).reshape(-1)[0]) if len(ins) > 1 and ins[1] is not None else \
        float(attrs.get("ratio", 0.5))
    if training and ratio > 0:
        x = _need(ins[0], "data")
        rng = np.random.RandomState(int(attrs["seed"]) if "seed" in attrs else None)
        keep = rng.uniform(0, 1.0, x.shape) >= ratio
        scale = cval((keep / (1.0 - ratio)).astype(np.float32))
        scale.runtime = True
        out = [tr.val(tr.op("mul", tr.t(x), tr.t(scale)), x.shape, F32)]
        if len(node.output) > 1 and node.output[1]:
            mask = cval(keep)
            mask.runtime = True
            out.append(mask)
        return out
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
        # tanh(softplus(x)) = n / (n + 2), n = e^x (e^x + 2): no cancellation for negative x, where
        # tanh of a tiny softplus loses its relative precision; past x = 20 the ratio is 1 in f32
        e = tr.op("exp", tr.op("clamp", t, lo=None, hi=20.0))
        n = tr.op("mul", e, tr.op("scale", e, scale=1.0, bias=2.0))
        out = tr.op("mul", t, tr.op("div", n, tr.op("scale", n, scale=1.0, bias=2.0)))
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
    """Cast between Flare's dtypes; a target Flare lacks is computed in its carrier (values.CARRIER)
    and brought to its range there: float16 rounded through f16, narrow integers wrapped."""
    from ..values import CARRIER, NARROW_FLOATS, np_dtype_of

    from .base import NARROW_INTS, SUB_BYTE_INTS, wrap_int

    x = ins[0]
    if node.op_type == "CastLike":
        to = np.dtype(ins[1].carried_from or ins[1].dtype)
    else:
        to = np.dtype(np_dtype_of(attrs["to"], "Cast.to"))
    held = CARRIER.get(to, to)
    if held not in (F32, I32, I64, BOOL):
        raise OnnxError(f"cast to {to.name} is not supported")
    t = tr.t(x)
    if held == BOOL:
        zero = _full(tr, 0, x.dtype if x.dtype != BOOL else np.int32)
        out = tr.op("logical_not", tr.op("equal", t, zero))
    elif _fd(held) == _fd(x.dtype):
        out = tr.op("contiguous", t)
    else:
        out = tr.op("cast", t, dtype=_fd(held))
    if to == np.dtype(np.float16):
        out = tr.op("cast", tr.op("cast", out, dtype="f16"), dtype="f32")
    elif to in NARROW_FLOATS:  # saturate (opset 19+) is defined for the float8 formats only
        fmt = NARROW_FLOATS[to]
        out = tr.op("round_float", out, mode=fmt, saturate=fmt.startswith("float8") and bool(attrs.get("saturate", 1)))
    elif to in SUB_BYTE_INTS and x.dtype == F32:
        # ml_dtypes' int4/uint4/int2/uint2 from a float, as onnx's reference casts: truncated, 0 out of range
        bits, signed = NARROW_INTS[to]
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        inside = tr.op("logical_and", tr.op("greater_equal", out, _full(tr, lo, np.int32)),
                       tr.op("less_equal", out, _full(tr, hi, np.int32)))
        out = tr.op("where", inside, out, _full(tr, 0, np.int32))
    elif to in NARROW_INTS:
        out = wrap_int(tr, out, to)
    return [tr.val(out, x.shape, to)]


@lowers("BitCast")
def _bitcast(tr, node, ins, attrs):
    """Same-width reinterpretation: f32 <-> int32 by op bitcast; between integers (carried
    sign-extended in i32/i64) a cast and a wrap to the target's width; bool to a byte a cast."""
    from ..values import CARRIER, np_dtype_of

    from .base import NARROW_INTS, wrap_int

    x = ins[0]
    src = np.dtype(x.carried_from or x.dtype)
    to = np.dtype(np_dtype_of(attrs["to"], "BitCast.to"))
    held = CARRIER.get(to, to)
    if src.itemsize != to.itemsize:
        raise OnnxError(f"bitcast of {src.name} to {to.name}: widths differ")
    t = tr.t(x)
    if {src, to} == {F32, I32}:
        out = tr.op("bitcast", t, dtype=_fd(to))
    elif src.kind in "iub" and to.kind in "iu" and held in INTS:
        out = t if _fd(held) == _fd(x.dtype) else tr.op("cast", t, dtype=_fd(held))
        out = wrap_int(tr, out, to) if to in NARROW_INTS else tr.op("contiguous", out)
    else:
        raise OnnxError(f"bitcast of {src.name} to {to.name} is not supported (its carriers differ in width)")
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


def _quant_param(tr, v, shape, axis: int, block: int, t=None):
    """A scale or zero point (or `t`, a tensor made from it) shaped to broadcast over x: per
    tensor, per axis (1-D along `axis`), or per block (repeated block_size times along `axis`
    by a gather)."""
    t = tr.t(v) if t is None else t
    if int(np.prod(v.shape, dtype=np.int64)) == 1 and not block:
        return t
    if block:
        return tr.op("take", t, tr.t(cval((np.arange(shape[axis]) // block).astype(np.int64))), axis=axis)
    view = [1] * len(shape)
    view[axis] = v.shape[0]
    return tr.op("reshape", t, shape=view)


def _as_f32(tr, t):
    return t if t.dtype == "f32" else tr.op("cast", t, dtype="f32")


@lowers("DequantizeLinear")
def _dequantize_linear(tr, node, ins, attrs):
    """(x - zero_point) * scale in f32, over the carriers (values.CARRIER) of the quantized dtypes."""
    from ..values import np_dtype_of

    x, scale = ins[0], ins[1]
    zp = ins[2] if len(ins) > 2 else None
    axis = _axis_of(attrs.get("axis", 1), len(x.shape))
    block = int(attrs.get("block_size", 0))
    t = _as_f32(tr, tr.t(x))
    if zp is not None:
        t = tr.op("sub", t, _as_f32(tr, _quant_param(tr, zp, x.shape, axis, block)))
    out = tr.op("mul", t, _quant_param(tr, scale, x.shape, axis, block))
    to = np_dtype_of(attrs["output_dtype"], "output_dtype") if attrs.get("output_dtype") else \
        (scale.carried_from or scale.dtype)
    if np.dtype(to) == np.dtype(np.float16):
        out = tr.op("cast", tr.op("cast", out, dtype="f16"), dtype="f32")
    return [tr.val(out, x.shape, to)]


@lowers("QuantizeLinear")
def _quantize_linear(tr, node, ins, attrs):
    """round(x / scale) + zero_point clamped to the target's range (an integer type), or x / scale
    rounded to a float8 (saturated) / float4 format, as onnx's reference quantizes."""
    from ..values import NARROW_FLOATS, np_dtype_of

    from .base import NARROW_INTS

    x, scale = ins[0], ins[1]
    zp = ins[2] if len(ins) > 2 else None
    axis = _axis_of(attrs.get("axis", 1), len(x.shape))
    block = int(attrs.get("block_size", 0))
    to = np.dtype(zp.carried_from or zp.dtype) if zp is not None else \
        np.dtype(np_dtype_of(attrs["output_dtype"], "output_dtype")) if attrs.get("output_dtype") else np.dtype(np.uint8)
    q = tr.op("div", _as_f32(tr, tr.t(x)), _as_f32(tr, _quant_param(tr, scale, x.shape, axis, block)))
    if to in NARROW_FLOATS:
        fmt = NARROW_FLOATS[to]
        if fmt.startswith("float4") and zp is not None:
            q = tr.op("add", q, _as_f32(tr, _quant_param(tr, zp, x.shape, axis, block)))
        out = tr.op("round_float", q, mode=fmt, saturate=fmt.startswith("float8") and bool(attrs.get("saturate", 1)))
        return [tr.val(out, x.shape, to)]
    if to in NARROW_INTS or to in (I32, np.dtype(np.int8), np.dtype(np.uint8)):
        bits, signed = NARROW_INTS.get(to, (32, True))
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        out = tr.op("cast", tr.op("round", q), dtype="i32")
        if zp is not None:
            z = tr.t(zp) if tr.t(zp).dtype == "i32" else tr.op("cast", tr.t(zp), dtype="i32")  # uint32: i64
            out = tr.op("int_add", out, _quant_param(tr, zp, x.shape, axis, block, t=z))
        out = tr.op("minimum", tr.op("maximum", out, _full(tr, lo, np.int32)), _full(tr, hi, np.int32))
        return [tr.val(out, x.shape, to)]
    raise OnnxError(f"quantizing to {to.name} is not supported")


def _axis_of(axis: int, rank: int) -> int:
    return axis % max(rank, 1)
