"""Conformance cases of the ops imported ONNX graphs brought in (flare.core.ops.math_ops,
indexing, spatial). Same contract and tolerances as cases.py (see its docstring):
exact for selection, comparison, integer and layout ops; TRANSC for float math
(device libraries may differ by a few ulp); ACCUM for reductions, scans and
convolution/averaging windows (f32 accumulation order)."""
from __future__ import annotations

import numpy as np

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cases import Case


def _ints(rng, *shape, lo=-9, hi=9, dtype=np.int64):
    return rng.integers(lo, hi, shape).astype(dtype)


def onnx_op_cases() -> list[Case]:
    # imported here, not above: cases.py builds CASES from this function at its own import, so a
    # module-level import would be circular when this module is imported first
    from .cases import ACCUM, ARITH, EXACT, TRANSC, _in, f32, simple, unary

    cases: list[Case] = []
    for op in ("abs", "ceil", "floor", "round", "sign"):
        cases.append(unary(op, EXACT))
    for op, lo, hi in (("log", 0.1, 4.0), ("reciprocal", 0.5, 3.0), ("sin", -3.0, 3.0), ("cos", -3.0, 3.0),
                       ("tan", -1.2, 1.2), ("asin", -0.9, 0.9), ("acos", -0.9, 0.9), ("atan", -3.0, 3.0),
                       ("sinh", -3.0, 3.0), ("cosh", -3.0, 3.0), ("asinh", -3.0, 3.0), ("acosh", 1.1, 4.0),
                       ("atanh", -0.9, 0.9), ("erf", -3.0, 3.0), ("softplus", -5.0, 5.0), ("softsign", -3.0, 3.0)):
        cases.append(unary(op, TRANSC, lo, hi))
    cases.append(simple("clamp", "clamp", EXACT,
                        lambda b, r, i: b.op("clamp", _in(b, i, "x", f32(r, 4, 6)), lo=-0.5, hi=0.75)))
    for op in ("minimum", "maximum"):
        cases.append(simple(op, op, EXACT, lambda b, r, i, op=op: b.op(
            op, _in(b, i, "a", f32(r, 3, 4)), _in(b, i, "b", f32(r, 1, 4)))))
        cases.append(simple(f"{op}_i64", op, EXACT, lambda b, r, i, op=op: b.op(
            op, _in(b, i, "a", _ints(r, 3, 4)), _in(b, i, "b", _ints(r, 3, 1)))))
    cases.append(simple("pow", "pow", TRANSC, lambda b, r, i: b.op(
        "pow", _in(b, i, "a", f32(r, 3, 4, lo=0.2, hi=3.0)), _in(b, i, "b", f32(r, 3, 4)))))
    for fmod in (False, True):
        cases.append(simple(f"mod_fmod{int(fmod)}", "mod", ARITH, lambda b, r, i, fmod=fmod: b.op(
            "mod", _in(b, i, "a", f32(r, 3, 4, lo=-5, hi=5)), _in(b, i, "b", f32(r, 3, 4, lo=0.5, hi=2)), fmod=fmod)))
    cases.append(simple("mod_i32", "mod", EXACT, lambda b, r, i: b.op(
        "mod", _in(b, i, "a", _ints(r, 3, 4, dtype=np.int32)), _in(b, i, "b", _ints(r, 3, 4, lo=1, hi=5, dtype=np.int32)))))
    for op in ("int_add", "int_sub", "int_mul", "int_div"):
        cases.append(simple(op, op, EXACT, lambda b, r, i, op=op: b.op(
            op, _in(b, i, "a", _ints(r, 3, 4, lo=-50, hi=50)), _in(b, i, "b", _ints(r, 1, 4, lo=1, hi=7)))))
    for op in ("bitwise_and", "bitwise_or", "bitwise_xor"):
        cases.append(simple(op, op, EXACT, lambda b, r, i, op=op: b.op(
            op, _in(b, i, "a", _ints(r, 3, 4, lo=-300, hi=300)), _in(b, i, "b", _ints(r, 1, 4, lo=-300, hi=300)))))
    cases.append(simple("bitwise_not", "bitwise_not", EXACT, lambda b, r, i: b.op(
        "bitwise_not", _in(b, i, "a", _ints(r, 3, 4, lo=-300, hi=300, dtype=np.int32)))))
    for mode in ("left", "right", "right_logical"):
        for dtype in (np.int32, np.int64):  # counts past the width and negative ones included
            cases.append(simple(f"bit_shift_{mode}_{np.dtype(dtype).name}", "bit_shift", EXACT,
                                lambda b, r, i, mode=mode, dtype=dtype: b.op(
                "bit_shift", _in(b, i, "a", _ints(r, 3, 5, lo=-1000, hi=1000, dtype=dtype)),
                _in(b, i, "b", np.array([0, 3, -1, 64, 31], dtype=dtype)), mode=mode)))
    for mode in ("linear", "nearest", "cubic"):
        for pad in ("zeros", "border", "reflection"):  # grid points past the edges included
            cases.append(simple(f"grid_sample_{mode}_{pad}", "grid_sample", ACCUM, lambda b, r, i, mode=mode, pad=pad: b.op(
                "grid_sample", _in(b, i, "x", f32(r, 2, 3, 4, 5)), _in(b, i, "g", f32(r, 2, 3, 6, 2, lo=-1.3, hi=1.3)),
                mode=mode, padding_mode=pad, align_corners=pad == "border")))
    cases.append(simple("bitcast_f32_i32", "bitcast", EXACT, lambda b, r, i: b.op(
        "bitcast", _in(b, i, "x", f32(r, 3, 5)), dtype="i32")))
    cases.append(simple("bitcast_i32_f32", "bitcast", EXACT, lambda b, r, i: b.op(
        "bitcast", _in(b, i, "x", _ints(r, 3, 5, lo=-(1 << 30), hi=1 << 30, dtype=np.int32)), dtype="f32")))
    for fmt in ("bfloat16", "float8_e4m3fn", "float8_e5m2fnuz", "float4_e2m1fn"):
        for saturate in (False, True):  # values past each format's range, infinities and a NaN included
            cases.append(simple(f"round_float_{fmt}_sat{int(saturate)}", "round_float", EXACT,
                                lambda b, r, i, fmt=fmt, saturate=saturate: b.op(
                "round_float", _in(b, i, "x", np.concatenate([f32(r, 12, lo=-20.0, hi=20.0), np.array(
                    [1e6, -1e6, np.inf, -np.inf, np.nan, 0.0, 3.3e-3, 448.0], dtype=np.float32)]).reshape(4, 5)),
                mode=fmt, saturate=saturate)))
    for op in ("equal", "less", "less_equal", "greater", "greater_equal"):
        cases.append(simple(op, op, EXACT, lambda b, r, i, op=op: b.op(
            op, _in(b, i, "a", np.round(f32(r, 3, 4))), _in(b, i, "b", np.round(f32(r, 1, 4))))))
    for op in ("logical_and", "logical_or", "logical_xor"):
        cases.append(simple(op, op, EXACT, lambda b, r, i, op=op: b.op(
            op, _in(b, i, "a", _ints(r, 3, 4, lo=0, hi=2, dtype=np.int32)),
            _in(b, i, "b", _ints(r, 3, 4, lo=0, hi=2, dtype=np.int32)))))
    cases.append(simple("logical_not", "logical_not", EXACT, lambda b, r, i: b.op(
        "logical_not", _in(b, i, "a", _ints(r, 3, 4, lo=0, hi=2, dtype=np.int32)))))
    cases.append(simple("isnan", "isnan", EXACT, lambda b, r, i: b.op(
        "isnan", _in(b, i, "a", np.where(f32(r, 3, 4) > 1, np.nan, 1.0).astype(np.float32)))))
    cases.append(simple("where", "where", EXACT, lambda b, r, i: b.op(
        "where", _in(b, i, "c", _ints(r, 3, 1, lo=0, hi=2, dtype=np.int32)),
        _in(b, i, "a", f32(r, 3, 4)), _in(b, i, "b", f32(r, 1, 4)))))
    cases.append(simple("min", "min", EXACT, lambda b, r, i: b.op("min", _in(b, i, "x", f32(r, 3, 5, 4)), axis=1)))
    cases.append(simple("prod", "prod", ACCUM, lambda b, r, i: b.op(
        "prod", _in(b, i, "x", f32(r, 3, 5, lo=0.5, hi=1.5)), axis=-1, keepdims=True)))
    cases.append(simple("argmin", "argmin", EXACT, lambda b, r, i: b.op(
        "argmin", _in(b, i, "x", f32(r, 3, 5, 4)), axis=1, select_last=True)))
    cases.append(simple("arg_max", "arg_max", EXACT, lambda b, r, i: b.op(
        "arg_max", _in(b, i, "x", np.round(f32(r, 3, 5, 4))), axis=2, keepdims=True, select_last=True)))
    cases.append(simple("cumsum", "cumsum", ACCUM, lambda b, r, i: b.op(
        "cumsum", _in(b, i, "x", f32(r, 3, 6)), axis=1, exclusive=True, reverse=True)))
    cases.append(simple("cumprod", "cumprod", ACCUM, lambda b, r, i: b.op(
        "cumprod", _in(b, i, "x", f32(r, 3, 6, lo=0.5, hi=1.5)), axis=1, exclusive=True)))
    cases.append(simple("scatter_elements", "scatter_elements", EXACT, lambda b, r, i: b.op(
        "scatter_elements", _in(b, i, "x", f32(r, 4, 5)), _in(b, i, "idx", np.array([[1, -1], [0, 2], [4, 3], [2, 2]])),
        _in(b, i, "u", f32(r, 4, 2)), axis=1, mode="add")))
    cases.append(simple("gather_nd", "gather_nd", EXACT, lambda b, r, i: b.op(
        "gather_nd", _in(b, i, "x", f32(r, 4, 5, 3)), _in(b, i, "idx", np.array([[0, 1], [3, -1], [2, 2]])))))
    cases.append(simple("scatter_nd", "scatter_nd", EXACT, lambda b, r, i: b.op(
        "scatter_nd", _in(b, i, "x", f32(r, 4, 5)), _in(b, i, "idx", np.array([[0], [3]])),
        _in(b, i, "u", f32(r, 2, 5)))))
    cases.append(simple("take", "take", EXACT, lambda b, r, i: b.op(
        "take", _in(b, i, "x", f32(r, 4, 5, 3)), _in(b, i, "idx", np.array([[0, -1], [2, 4]], np.int64)), axis=1)))
    cases.append(simple("take_along_axis", "take_along_axis", EXACT, lambda b, r, i: b.op(
        "take_along_axis", _in(b, i, "x", f32(r, 4, 5)), _in(b, i, "idx", _ints(r, 4, 3, lo=-5, hi=5)), axis=1)))
    cases.append(simple("expand", "expand", EXACT, lambda b, r, i: b.op(
        "expand", _in(b, i, "x", f32(r, 3, 1)), shape=[2, 3, 4])))
    cases.append(simple("flip", "flip", EXACT, lambda b, r, i: b.op("flip", _in(b, i, "x", f32(r, 3, 4)), axis=0)))
    cases.append(simple("tile", "tile", EXACT, lambda b, r, i: b.op(
        "tile", _in(b, i, "x", f32(r, 2, 3)), repeats=[2, 3])))
    cases.append(simple("conv2d", "conv2d", ACCUM, lambda b, r, i: b.op(
        "conv2d", _in(b, i, "x", f32(r, 2, 4, 7, 6)), _in(b, i, "w", f32(r, 6, 2, 3, 2)), strides=[2, 1],
        dilations=[1, 2], pads=[[1, 1], [0, 2]], groups=2)))
    # depthwise (groups = channels): the NumPy kernel's one-einsum path
    cases.append(simple("conv2d_depthwise", "conv2d", ACCUM, lambda b, r, i: b.op(
        "conv2d", _in(b, i, "x", f32(r, 1, 6, 1, 13)), _in(b, i, "w", f32(r, 6, 1, 1, 3)), dilations=[1, 3],
        pads=[[0, 0], [3, 3]], groups=6)))
    # a 1-D convolution as imported graphs run it (H = 1, one group, asymmetric pads): the CPU's native conv1d
    cases.append(simple("conv2d_1d", "conv2d", ACCUM, lambda b, r, i: b.op(
        "conv2d", _in(b, i, "x", f32(r, 2, 5, 1, 19)), _in(b, i, "w", f32(r, 7, 5, 1, 4)), strides=[1, 2],
        dilations=[1, 2], pads=[[0, 0], [1, 3]])))
    cases.append(simple("conv2d_1d_bias", "conv2d", ACCUM, lambda b, r, i: b.op(
        "conv2d", _in(b, i, "x", f32(r, 1, 4, 1, 23)), _in(b, i, "w", f32(r, 6, 4, 1, 3)), _in(b, i, "b", f32(r, 6)),
        pads=[[0, 0], [1, 1]])))
    cases.append(simple("conv2d_bias", "conv2d", ACCUM, lambda b, r, i: b.op(
        "conv2d", _in(b, i, "x", f32(r, 1, 4, 5, 6)), _in(b, i, "w", f32(r, 2, 2, 3, 3)), _in(b, i, "b", f32(r, 2)),
        pads=[[1, 1], [1, 1]], groups=2)))
    cases.append(simple("max_pool2d", "max_pool2d", EXACT, lambda b, r, i: b.op(
        "max_pool2d", _in(b, i, "x", f32(r, 1, 2, 7, 6)), kernel=[3, 2], strides=[2, 2], pads=[[1, 1], [0, 1]],
        ceil_mode=True)))
    for inc in (False, True):
        cases.append(simple(f"avg_pool2d_pad{int(inc)}", "avg_pool2d", ACCUM, lambda b, r, i, inc=inc: b.op(
            "avg_pool2d", _in(b, i, "x", f32(r, 1, 2, 7, 6)), kernel=[3, 3], strides=[2, 2], pads=[[1, 1], [1, 1]],
            ceil_mode=True, count_include_pad=inc)))
    return cases


def importer_ops() -> frozenset[str]:
    """The ops added for imported ONNX graphs (math, indexing, spatial): NumPy kernels on the
    CPU only so far; the GPU backends refuse them in supports() and the scheduler places
    them on the CPU. Tests of "every op has a GPU kernel / a native CPU command" exempt them."""
    return frozenset(c.op for c in onnx_op_cases())


def refused_beyond_the_importer_ops(output: str) -> list[str]:
    """Ops a conformance run's coverage summary (its "refused (skipped ...):" lines) says were
    refused, less importer_ops(): what a GPU backend should have run but did not."""
    refused = set()
    for line in output.splitlines():
        if line.strip().startswith("refused (skipped"):
            refused |= {op.strip() for op in line.split(":", 1)[1].split(",") if op.strip()}
    return sorted(refused - importer_ops())
