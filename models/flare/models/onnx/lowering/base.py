"""The lowering registry and the helpers every lowering shares (constants, shapes, axes, folding).

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

from typing import Any, Callable

import ml_dtypes
import numpy as np

from ..errors import OnnxError
from ..values import BOOL, CARRIER, Val, carrier, flare_shape

F32 = np.dtype(np.float32)
I64 = np.dtype(np.int64)
I32 = np.dtype(np.int32)
INTS = (I32, I64)
Lowering = Callable[..., list]
LOWERINGS: dict[str, Lowering] = {}
# ops that take *wide* values (rank > 4, held contiguously in a merged Flare shape: values.flare_shape)
WIDE_OK = {"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Identity", "Shape", "Size", "Dropout", "Cast", "CastLike",
           "MaxPool", "AveragePool", "LpPool",  # 3-D pooling (rank 5) runs as two 2-D pools
           "BatchNormalization", "GatherND", "ScatterND",  # these two take wide *index* tensors
           "Concat", "GatherElements", "Slice", "Transpose", *("ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 "
                                                   "ReduceL2 ReduceSumSquare ReduceLogSum ReduceLogSumExp").split()}
HOST_STEPS: dict[str, Callable[..., list]] = {}


def lowers(*names: str):
    def deco(fn):
        for n in names:
            LOWERINGS[n] = _carried(fn)
        return fn
    return deco


# integer dtypes narrower than their carrier: (bits, signed); arithmetic re-wraps them to their width
NARROW_INTS = {np.dtype(np.int8): (8, True), np.dtype(np.uint8): (8, False), np.dtype(np.int16): (16, True),
               np.dtype(np.uint16): (16, False), np.dtype(np.uint32): (32, False)}
SUB_BYTE_INTS = {np.dtype(getattr(ml_dtypes, n)): (bits, n[0] == "i")
                 for n, bits in (("int4", 4), ("uint4", 4), ("int2", 2), ("uint2", 2))}
NARROW_INTS.update(SUB_BYTE_INTS)
# ops whose integer results may leave their inputs' range
WRAPPING = {"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sum", "Pow", "BitShift", "CumSum", "MatMul", "Gemm",
            "ReduceSum", "ReduceProd", "ReduceSumSquare", "Einsum", "BitwiseNot"}


_NATIVE = frozenset({F32, I64, I32, BOOL})  # dtypes a lowering sees as they are (no carrier)


def _carried(fn: Lowering) -> Lowering:
    """Run a lowering over values of dtypes Flare lacks (values.CARRIER) as their carriers.

    Inside a lowering every value has the dtype of the tensor that holds it (float64 -> float32,
    int8 -> int32, ...), so lowerings know only Flare's dtypes. Afterwards the inputs get their
    ONNX dtypes back and each output the dtype ONNX's own type inference gives it; a narrow
    integer result of arithmetic is wrapped to its width, as the ONNX op would."""
    def run(tr, node, ins, attrs):
        for v in ins:  # the common case first: every input of a dtype Flare has (no dict, no np.dtype())
            if v is not None and v.dtype not in _NATIVE:
                break
        else:
            return fn(tr, node, ins, attrs)
        narrowed = {id(v): (v, v.dtype) for v in ins if v is not None and np.dtype(v.dtype) in CARRIER}
        if not narrowed:
            return fn(tr, node, ins, attrs)
        for v, dtype in narrowed.values():
            v.dtype, v.carried_from = carrier(dtype), dtype
        try:
            outs = fn(tr, node, ins, attrs)
        finally:
            for v, dtype in narrowed.values():
                v.dtype, v.carried_from = dtype, None
                if v.const is not None and np.asarray(v.const).dtype != dtype:
                    v.const = np.asarray(v.const).astype(dtype)
        return _onnx_dtypes(tr, node, ins, outs)
    run.__name__, run.__doc__, run.__wrapped__ = fn.__name__, fn.__doc__, fn
    return run


def _onnx_dtypes(tr, node, ins, outs: list) -> list:
    """Give a carried lowering's outputs their ONNX dtypes (onnx.shape_inference's per-node rule)."""
    from onnx import defs, helper, shape_inference

    from ..values import np_dtype_of

    try:
        schema = defs.get_schema(node.op_type, tr.opset, node.domain)
        types = {name: helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(np.dtype(v.dtype)), None)
                 for name, v in zip(node.input, ins) if name and v is not None}
        inferred = shape_inference.infer_node_outputs(schema, node, types)
    except Exception:  # no schema or no rule: the carriers stand
        return outs
    for name, v in zip(node.output, outs):
        t = inferred.get(name)
        if v is None or t is None or not t.HasField("tensor_type") or not t.tensor_type.elem_type:
            continue
        want = np_dtype_of(t.tensor_type.elem_type, name, strict=False)
        if want is None or want == v.dtype or carrier(want) != np.dtype(v.dtype):
            continue
        if v.const is not None:
            v.const = np.asarray(v.const).astype(want)
        elif want in NARROW_INTS and node.op_type in WRAPPING:
            v.tensor = wrap_int(tr, v.tensor, want)
        v.dtype = want
    return outs


def wrap_int(tr, t, dtype) -> Any:
    """A carried integer tensor wrapped to the width of `dtype` (two's complement, as a cast would)."""
    bits, signed = NARROW_INTS[np.dtype(dtype)]
    fd = t.dtype
    np_fd = np.int32 if fd == "i32" else np.int64
    span = _full(tr, 1 << bits, np_fd)
    if not signed:
        return tr.op("mod", t, span)
    half = _full(tr, 1 << (bits - 1), np_fd)
    return tr.op("int_sub", tr.op("mod", tr.op("int_add", t, half), span), half)


def attributes(node: Any) -> dict[str, Any]:
    from onnx import helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        out[a.name] = v
    return out


FOLD_OPS_KEPT = 8192  # reference-kernel objects a runner keeps for folds (cleared when full)


def fold(tr: Any, node: Any, ins: list) -> list:
    """Evaluate a node of constants on the host with onnx.reference (the file's own semantics)."""
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.ops import load_op

    try:
        # the kernel object (its attributes parsed) is kept per runner by the node's bytes: a
        # trace folds the same shape arithmetic again for every new input shape
        ops = getattr(getattr(tr, "runner", None), "_fold_ops", None)
        key = (node.SerializeToString(), tr.opset) if ops is not None else None
        op = ops.get(key) if ops is not None else None
        if op is None:
            cls = load_op(node.domain, node.op_type, tr.opset if node.domain in ("", "ai.onnx") else None)
            run_params = {"log": lambda *a: None, "opsets": {"": tr.opset}, "verbose": 0, "new_ops": None,
                          "existing_functions": {}, "evaluator_cls": ReferenceEvaluator}
            op = cls(node, run_params)
            if ops is not None:
                if len(ops) >= FOLD_OPS_KEPT:
                    ops.clear()
                ops[key] = op
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
    first = vals[0].shape
    if all(v.shape == first for v in vals[1:]):  # the common case, without NumPy's general rule
        return tuple(first)
    try:
        return tuple(np.broadcast_shapes(*[v.shape for v in vals]))
    except ValueError:
        raise OnnxError(f"shapes {' and '.join(str(v.shape) for v in vals)} do not broadcast") from None


def _fd(dtype) -> str:
    return {F32: "f32", I32: "i32", I64: "i64", BOOL: "i32"}[np.dtype(dtype)]


@lowers("Identity")
def _identity(tr, node, ins, attrs):
    x = ins[0]
    return [Val("", x.shape, x.dtype, const=x.const, tensor=x.tensor, runtime=x.runtime, fixed=x.fixed)]


def _where_pos(tr, x, pos, neg, strict=True):
    """where(x > 0, pos, neg) (or x >= 0) over f32 tensors."""
    zero = _full(tr, 0.0, np.float32)
    cond = tr.op("greater" if strict else "greater_equal", x, zero)
    return tr.op("where", cond, pos, neg)


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


def _reduce_chain(tr, t, shape, axes, keep, op):
    rank = len(shape)
    axes = sorted({_axis(a, rank) for a in (range(rank) if axes is None else axes)}, reverse=True)
    for a in axes:
        t = tr.op(op, t, axis=a, keepdims=True)
    out_shape = tuple(1 if i in axes else d for i, d in enumerate(shape)) if keep else \
        tuple(d for i, d in enumerate(shape) if i not in axes)
    return t, out_shape


def _reshape_to(tr, x: Val, shape: tuple[int, ...]) -> list:
    if x.is_const and not x.runtime:
        return [cval(np.asarray(x.const).reshape(shape))]
    return [tr.val(tr.op("reshape", tr.t(x), shape=list(flare_shape(shape))), shape, x.dtype)]


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


def _indices(tr, v: Val):
    t = tr.t(v)
    return t


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


def _channel_vec(tr, v: Val, rank: int):
    """A per-channel [C] value shaped [C, 1, ...] to broadcast over [N, C, ...]."""
    return tr.op("reshape", tr.t(v), shape=[v.shape[0]] + [1] * (rank - 2))


def _norm_tail(tr, x, flat_shape, norm_op, eps, shape_after):
    t = tr.op("reshape", tr.t(x), shape=flat_shape)
    return tr.op("reshape", tr.op(norm_op, t, eps=eps), shape=shape_after)


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
