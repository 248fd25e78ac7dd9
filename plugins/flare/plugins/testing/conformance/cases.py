"""Conformance cases: small graphs per op, with the tolerance each op is held to.

Tolerances (|got - ref| <= atol + rtol*|ref|, the reference in float64):
- exact ops (layout, copies, indexing, cast, set_rows, argmax/top_k): 0.
- elementwise arithmetic: rtol 1e-6 — one f32 rounding per element.
- transcendental (exp, tanh, sigmoid, silu, gelu, sqrt): rtol 1e-5, atol 1e-6 —
  device math libraries are allowed a few ulp (GLSL exp/tanh, CUDA __expf-free
  but still ~2 ulp), and erf approximations ~1.5e-7 absolute.
- reductions, norms, softmax, matmul, conv1d, mul_mat_id, rope: rtol 1e-4,
  atol 1e-5 — f32 accumulation in a different order than NumPy's pairwise sum
  gives errors growing with the reduction length (here <= 64) times f32 eps.
- block-quantized weights: see quant_cases.py (dequantization exact, products QUANT_DOT).
- lstm: the same — each step is a length-H dot product (H <= 300 here) and a few
  transcendentals; the cell is contractive (|f| < 1, |tanh| <= 1), so per-step
  errors do not compound over the steps (measured: 2-4e-7 after 64 steps).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from flare.core.graph import GraphBuilder, Tensor

EXACT = (0.0, 0.0)
ARITH = (1e-6, 1e-7)
TRANSC = (1e-5, 1e-6)
ACCUM = (1e-4, 1e-5)


@dataclass
class Case:
    """One conformance graph: `build(b, rng)` returns (output tensor, inputs dict)."""

    id: str
    op: str
    build: Callable[[GraphBuilder, np.random.Generator], tuple[Tensor, dict[str, np.ndarray]]]
    tol: tuple[float, float] = ACCUM
    tags: tuple[str, ...] = field(default_factory=tuple)


def f32(rng, *shape, lo=-2.0, hi=2.0):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def _in(b, inputs, name, arr):
    inputs[name] = arr
    from flare.core.dtypes import from_numpy
    return b.input(name, arr.shape, from_numpy(arr.dtype))


def unary(op, tol, lo=-3.0, hi=3.0):
    def build(b, rng):
        inputs = {}
        x = _in(b, inputs, "x", f32(rng, 3, 5, 7, lo=lo, hi=hi))
        return b.op(op, x), inputs
    return Case(op, op, build, tol)


def binary(op, shape_a, shape_b, tol=ARITH, suffix=""):
    def build(b, rng):
        inputs = {}
        a = _in(b, inputs, "a", f32(rng, *shape_a))
        c = _in(b, inputs, "b", f32(rng, *shape_b, lo=0.5, hi=2.0) if op == "div" else f32(rng, *shape_b))
        return b.op(op, a, c), inputs
    return Case(f"{op}{suffix}", op, build, tol)


def simple(case_id, op, tol, make):
    """`make(b, rng, inputs)` builds and returns the output tensor."""
    def build(b, rng):
        inputs: dict[str, np.ndarray] = {}
        return make(b, rng, inputs), inputs
    return Case(case_id, op, build, tol)


def _cases() -> list[Case]:
    cases: list[Case] = []
    for op in ("add", "sub", "mul", "div"):
        cases.append(binary(op, (4, 6), (4, 6)))
        cases.append(binary(op, (2, 4, 6), (6,), suffix="_bcast_row"))
        cases.append(binary(op, (3, 1, 5), (1, 4, 1), suffix="_bcast_both"))
    for op, tol in (("relu", EXACT), ("neg", EXACT), ("sqr", ARITH), ("exp", TRANSC), ("tanh", TRANSC),
                    ("sigmoid", TRANSC), ("silu", TRANSC), ("gelu", TRANSC)):
        cases.append(unary(op, tol))
    cases.append(unary("sqrt", TRANSC, lo=0.0, hi=4.0))
    cases.append(simple("scale", "scale", ARITH, lambda b, r, i: b.scale(_in(b, i, "x", f32(r, 4, 9)), scale=0.75, bias=-0.25)))
    cases.append(simple("matmul", "matmul", ACCUM, lambda b, r, i: b.matmul(_in(b, i, "a", f32(r, 5, 16)), _in(b, i, "w", f32(r, 16, 7)))))
    cases.append(simple("matmul_tb_batched", "matmul", ACCUM, lambda b, r, i: b.matmul(
        _in(b, i, "a", f32(r, 2, 3, 5, 16)), _in(b, i, "w", f32(r, 2, 3, 7, 16)), transpose_b=True)))
    cases.append(simple("matmul_bcast_weight", "matmul", ACCUM, lambda b, r, i: b.matmul(
        _in(b, i, "a", f32(r, 3, 4, 8)), b.weight("w", f32(r, 8, 6)))))
    cases.append(simple("matmul_f16_weight", "matmul", ACCUM, lambda b, r, i: b.matmul(
        _in(b, i, "a", f32(r, 4, 8)), b.weight("w", f32(r, 6, 8).astype(np.float16)), transpose_b=True)))
    cases.append(simple("matmul_of_transposed_view", "matmul", ACCUM, lambda b, r, i: b.matmul(
        b.transpose(_in(b, i, "a", f32(r, 16, 5))), _in(b, i, "w", f32(r, 16, 7)))))
    cases.append(simple("layer_norm", "layer_norm", ACCUM, lambda b, r, i: b.layer_norm(_in(b, i, "x", f32(r, 3, 4, 32)), eps=1e-5)))
    cases.append(simple("rms_norm", "rms_norm", ACCUM, lambda b, r, i: b.rms_norm(_in(b, i, "x", f32(r, 6, 24)), eps=1e-6)))
    cases.append(simple("softmax", "softmax", ACCUM, lambda b, r, i: b.softmax(_in(b, i, "x", f32(r, 2, 3, 17)), scale=0.5)))
    cases.append(simple("softmax_mask", "softmax", ACCUM, lambda b, r, i: b.softmax(
        _in(b, i, "x", f32(r, 2, 4, 6)), _in(b, i, "m", np.where(r.random((1, 4, 6)) < 0.3, -1e9, 0.0).astype(np.float32)))))
    # rows shorter than 16 (the CPU's 8-lane path), one lane past a vector of 8
    cases.append(simple("softmax_short_rows", "softmax", ACCUM, lambda b, r, i: b.softmax(_in(b, i, "x", f32(r, 5, 9)), scale=0.7)))
    cases.append(simple("get_rows", "get_rows", EXACT, lambda b, r, i: b.get_rows(
        b.weight("table", f32(r, 10, 8)), _in(b, i, "idx", r.integers(0, 10, (2, 5)).astype(np.int32)))))
    cases.append(simple("get_rows_f16", "get_rows", EXACT, lambda b, r, i: b.get_rows(
        b.weight("table", f32(r, 10, 8).astype(np.float16)), _in(b, i, "idx", r.integers(0, 10, (7,)).astype(np.int32)))))
    cases.append(simple("rope_neox", "rope", ACCUM, lambda b, r, i: b.rope(
        _in(b, i, "x", f32(r, 5, 2, 8)), _in(b, i, "pos", np.array([0, 1, 2, 7, 30], np.int32)))))
    cases.append(simple("rope_interleaved", "rope", ACCUM, lambda b, r, i: b.rope(
        _in(b, i, "x", f32(r, 3, 2, 6)), _in(b, i, "pos", np.array([3, 4, 100], np.int32)), neox=False, base=500.0)))
    cases.append(simple("conv1d", "conv1d", ACCUM, lambda b, r, i: b.conv1d(
        _in(b, i, "x", f32(r, 2, 3, 20)), b.weight("w", f32(r, 4, 3, 3)), padding=1)))
    cases.append(simple("conv1d_stride_dilation", "conv1d", ACCUM, lambda b, r, i: b.conv1d(
        _in(b, i, "x", f32(r, 1, 2, 33)), b.weight("w", f32(r, 3, 2, 5)), stride=2, dilation=2, padding=2)))
    cases.append(simple("conv1d_pointwise", "conv1d", ACCUM, lambda b, r, i: b.conv1d(
        _in(b, i, "x", f32(r, 2, 8, 9)), b.weight("w", f32(r, 5, 8, 1)))))
    cases.append(simple("lstm", "lstm", ACCUM, lambda b, r, i: _lstm(b, r, i, steps=6, batch=2, hidden=5)))
    cases.append(simple("pad_constant", "pad", EXACT, lambda b, r, i: b.pad(
        _in(b, i, "x", f32(r, 2, 5)), pads=((1, 0), (2, 3)), value=0.5)))
    cases.append(simple("pad_reflect", "pad", EXACT, lambda b, r, i: b.pad(
        _in(b, i, "x", f32(r, 2, 3, 10)), pads=((0, 0), (0, 0), (4, 4)), mode="reflect")))
    cases.append(simple("concat", "concat", EXACT, lambda b, r, i: b.concat(
        _in(b, i, "a", f32(r, 2, 3, 4)), _in(b, i, "b", f32(r, 2, 5, 4)), axis=1)))
    cases.append(simple("slice_step", "slice", EXACT, lambda b, r, i: b.slice(
        _in(b, i, "x", f32(r, 4, 11)), axis=1, start=1, stop=10, step=3)))
    cases.append(simple("reshape_permute", "permute", EXACT, lambda b, r, i: b.permute(
        b.reshape(_in(b, i, "x", f32(r, 4, 6)), shape=(2, 2, 6)), axes=(2, 0, 1))))
    cases.append(simple("contiguous_of_slice", "contiguous", EXACT, lambda b, r, i: b.contiguous(
        b.slice(b.transpose(_in(b, i, "x", f32(r, 5, 7))), axis=0, start=2, stop=6))))
    cases.append(simple("add_of_views", "add", ARITH, lambda b, r, i: b.add(
        b.transpose(_in(b, i, "a", f32(r, 6, 4))), b.slice(_in(b, i, "b", f32(r, 4, 9)), axis=1, start=3, stop=9))))
    for op in ("sum", "mean", "max"):
        cases.append(simple(f"{op}_last", op, ACCUM, (lambda o: lambda b, r, i: b.op(o, _in(b, i, "x", f32(r, 3, 4, 10)), axis=-1))(op)))
        cases.append(simple(f"{op}_mid_keep", op, ACCUM, (lambda o: lambda b, r, i: b.op(o, _in(b, i, "x", f32(r, 3, 4, 10)), axis=1, keepdims=True))(op)))
    cases.append(simple("argmax", "argmax", EXACT, lambda b, r, i: b.argmax(_in(b, i, "x", f32(r, 4, 13)))))
    cases.append(simple("top_k", "top_k", EXACT, lambda b, r, i: b.top_k(_in(b, i, "x", f32(r, 5, 12)), k=3)))
    cases.append(simple("top_k_ties", "top_k", EXACT, lambda b, r, i: b.top_k(
        _in(b, i, "x", np.array([[1, 3, 3, 0, 3, 2]], np.float32)), k=4)))
    # rows longer than a GPU workgroup/block (several elements per thread, several warps), odd
    # lengths, a row longer than a block's shared-memory sort (top_k in pieces); tolerance as
    # above: sums over 1000 terms stay within rtol 1e-4
    cases.append(simple("softmax_long_row", "softmax", ACCUM, lambda b, r, i: b.softmax(
        _in(b, i, "x", f32(r, 3, 1000)), _in(b, i, "m", f32(r, 1, 1000)), scale=0.3)))
    cases.append(simple("layer_norm_long_row", "layer_norm", ACCUM, lambda b, r, i: b.layer_norm(
        _in(b, i, "x", f32(r, 2, 1001)), eps=1e-5)))
    cases.append(simple("rms_norm_strided_long_row", "rms_norm", ACCUM, lambda b, r, i: b.rms_norm(
        b.transpose(_in(b, i, "x", f32(r, 777, 2))), eps=1e-6)))
    cases.append(simple("sum_long_row", "sum", ACCUM, lambda b, r, i: b.op("sum", _in(b, i, "x", f32(r, 2, 1500)), axis=-1)))
    cases.append(simple("max_long_row", "max", EXACT, lambda b, r, i: b.op("max", _in(b, i, "x", f32(r, 2, 1500)), axis=-1)))
    cases.append(simple("argmax_long_row", "argmax", EXACT, lambda b, r, i: b.argmax(_in(b, i, "x", f32(r, 2, 1500)))))
    cases.append(simple("top_k_long_row", "top_k", EXACT, lambda b, r, i: b.top_k(
        _in(b, i, "x", np.round(f32(r, 2, 3000), 2)), k=6)))
    cases.append(simple("gather", "gather", EXACT, lambda b, r, i: b.gather(
        _in(b, i, "x", f32(r, 4, 9)), _in(b, i, "idx", r.integers(0, 9, (4, 3)).astype(np.int32)))))
    cases.append(simple("mul_mat_id", "mul_mat_id", ACCUM, lambda b, r, i: b.mul_mat_id(
        b.weight("w", f32(r, 5, 6, 8)), _in(b, i, "x", f32(r, 4, 8)), _in(b, i, "ids", r.integers(0, 5, (4, 2)).astype(np.int32)))))
    cases.append(simple("mul_mat_id_per_slot_f16", "mul_mat_id", ACCUM, lambda b, r, i: b.mul_mat_id(
        b.weight("w", f32(r, 4, 6, 8).astype(np.float16)), _in(b, i, "x", f32(r, 3, 2, 8)),
        _in(b, i, "ids", np.array([[0, 3], [3, 3], [1, 2]], np.int32)))))
    # one token (a decode step): the CPU runs its slots without grouping them (mul_mat_id_slots)
    cases.append(simple("mul_mat_id_one_token", "mul_mat_id", ACCUM, lambda b, r, i: b.mul_mat_id(
        b.weight("w", f32(r, 5, 6, 8)), _in(b, i, "x", f32(r, 1, 8)), _in(b, i, "ids", np.array([[4, 1]], np.int32)))))
    cases.append(simple("mul_mat_id_one_token_per_slot", "mul_mat_id", ACCUM, lambda b, r, i: b.mul_mat_id(
        b.weight("w", f32(r, 5, 6, 8)), _in(b, i, "x", f32(r, 1, 3, 8)), _in(b, i, "ids", np.array([[2, 0, 3]], np.int32)))))
    cases.append(simple("set_rows", "set_rows", EXACT, lambda b, r, i: b.set_rows(
        b.state("cache", (8, 4)), _in(b, i, "idx", np.array([6, 1, 3], np.int32)), _in(b, i, "v", f32(r, 3, 4)))))
    cases.append(simple("copy_into", "copy_into", EXACT, lambda b, r, i: b.copy_into(
        b.state("st", (3, 5)), _in(b, i, "v", f32(r, 2, 4)), offset=5)))
    cases.append(simple("cast_f32_f16", "cast", EXACT, lambda b, r, i: b.cast(_in(b, i, "x", f32(r, 3, 8)), dtype="f16")))
    cases.append(simple("cast_f16_f32", "cast", EXACT, lambda b, r, i: b.cast(b.weight("h", f32(r, 3, 8).astype(np.float16)), dtype="f32")))
    cases.append(simple("cast_f32_i32", "cast", EXACT, lambda b, r, i: b.cast(_in(b, i, "x", f32(r, 3, 8, lo=-9, hi=9)), dtype="i32")))
    cases.append(simple("cast_i32_f32", "cast", EXACT, lambda b, r, i: b.cast(
        _in(b, i, "x", r.integers(-50, 50, (4, 4)).astype(np.int32)), dtype="f32")))
    cases += _gpu_kernel_cases()
    return cases


def _gpu_kernel_cases() -> list[Case]:
    """Shapes that reach every path of the GPU kernels (issue 16): tiles crossed by odd sizes
    (not multiples of 16, 32 or 64), k not a multiple of 4 (no vector loads), transposed,
    batched and broadcast operands, few rows on either side (matrix-vector), conv1d as a
    matmul, mul_mat_id with vector loads. Sizes stay small: lavapipe is slow."""
    mm = lambda cid, a, w, **kw: simple(cid, "matmul", ACCUM, lambda b, r, i: b.matmul(  # noqa: E731
        _in(b, i, "a", f32(r, *a)), _in(b, i, "w", f32(r, *w)), **kw))
    return [
        mm("matmul_tiled_odd_tb", (67, 40), (45, 40), transpose_b=True),      # vector loads, crosses 64-tiles
        mm("matmul_tiled_odd_k", (37, 19), (19, 70)),                          # scalar loads, k = 19
        mm("matmul_tiled_batched", (2, 3, 33, 20), (2, 3, 20, 34)),
        mm("matmul_tiled_batched_tb_bcast", (2, 1, 35, 12), (3, 33, 12), transpose_b=True),
        simple("matmul_stacked_rows_f16", "matmul", ACCUM, lambda b, r, i: b.matmul(
            _in(b, i, "a", f32(r, 3, 23, 32)), b.weight("w", f32(r, 40, 32).astype(np.float16)), transpose_b=True)),
        mm("matvec_rows_tb", (3, 36), (50, 36), transpose_b=True),             # few rows of a
        mm("matvec_rows_strided", (2, 13), (13, 9)),                           # few rows, b not k-contiguous
        mm("matvec_cols", (2, 40, 12), (2, 12, 3)),                            # few columns: operands swapped
        simple("matvec_f16_one_row", "matmul", ACCUM, lambda b, r, i: b.matmul(
            _in(b, i, "a", f32(r, 1, 24)), b.weight("w", f32(r, 9, 24).astype(np.float16)), transpose_b=True)),
        simple("conv1d_tiled_odd", "conv1d", ACCUM, lambda b, r, i: b.conv1d(
            _in(b, i, "x", f32(r, 3, 5, 37)), b.weight("w", f32(r, 70, 5, 3)), padding=1)),
        simple("conv1d_tiled_stride_vec", "conv1d", ACCUM, lambda b, r, i: b.conv1d(
            _in(b, i, "x", f32(r, 2, 4, 50)), b.weight("w", f32(r, 6, 4, 4)), stride=3, dilation=2, padding=3)),
        # taps read four at a time (CPU-driver matmul_lanes CONV_VEC): quads wholly in the
        # padding, and quads running past the end of the input
        simple("conv1d_vec_taps_padded", "conv1d", ACCUM, lambda b, r, i: b.conv1d(
            _in(b, i, "x", f32(r, 2, 3, 44)), b.weight("w", f32(r, 5, 3, 12)), stride=4, padding=4)),
        mm("matmul_rows_of_b_vec_odd", (13, 10), (10, 36)),                   # b contiguous along n, k = 10
        simple("mul_mat_id_vec", "mul_mat_id", ACCUM, lambda b, r, i: b.mul_mat_id(
            b.weight("w", f32(r, 4, 9, 16)), _in(b, i, "x", f32(r, 3, 16)),
            _in(b, i, "ids", np.array([[0, 3], [2, 2], [1, 0]], np.int32)))),
        # enough routed (token, slot) pairs for the tiled, per-expert kernel; odd sizes
        simple("mul_mat_id_many_tokens", "mul_mat_id", ACCUM, lambda b, r, i: b.mul_mat_id(
            b.weight("w", f32(r, 5, 70, 24)), _in(b, i, "x", f32(r, 37, 24)),
            _in(b, i, "ids", r.integers(0, 5, (37, 2)).astype(np.int32)))),
        simple("mul_mat_id_many_tokens_per_slot_f16", "mul_mat_id", ACCUM, lambda b, r, i: b.mul_mat_id(
            b.weight("w", f32(r, 3, 9, 13).astype(np.float16)), _in(b, i, "x", f32(r, 17, 2, 13)),
            _in(b, i, "ids", r.integers(0, 3, (17, 2)).astype(np.int32)))),
        # rows longer than any workgroup and of odd length: every invocation loops, partial subgroups
        simple("softmax_long_mask", "softmax", ACCUM, lambda b, r, i: b.softmax(
            _in(b, i, "x", f32(r, 3, 301)), _in(b, i, "m", np.where(r.random((1, 301)) < 0.2, -1e9, 0.0).astype(np.float32)),
            scale=0.3)),
        simple("layer_norm_long", "layer_norm", ACCUM, lambda b, r, i: b.layer_norm(_in(b, i, "x", f32(r, 2, 389)), eps=1e-5)),
        simple("rms_norm_long", "rms_norm", ACCUM, lambda b, r, i: b.rms_norm(_in(b, i, "x", f32(r, 3, 517)), eps=1e-6)),
        simple("sum_long", "sum", ACCUM, lambda b, r, i: b.op("sum", _in(b, i, "x", f32(r, 2, 3, 301)), axis=-1)),
        simple("max_long_mid", "max", ACCUM, lambda b, r, i: b.op("max", _in(b, i, "x", f32(r, 2, 259, 3)), axis=1)),
        simple("argmax_long_ties", "argmax", EXACT, lambda b, r, i: b.argmax(
            _in(b, i, "x", r.integers(0, 5, (3, 263)).astype(np.float32)))),
        simple("top_k_long", "top_k", EXACT, lambda b, r, i: b.top_k(_in(b, i, "x", f32(r, 3, 203)), k=7)),
        simple("top_k_many_ties", "top_k", EXACT, lambda b, r, i: b.top_k(
            _in(b, i, "x", r.integers(0, 4, (2, 50)).astype(np.float32)), k=20)),
        # runs of elementwise nodes (a backend may chain them into one kernel)
        simple("eltwise_run_bias_gelu", "gelu", TRANSC, lambda b, r, i: b.mul(b.gelu(b.scale(b.add(
            _in(b, i, "x", f32(r, 3, 5, 7)), _in(b, i, "bias", f32(r, 7))), scale=0.5, bias=0.1)), _in(b, i, "y", f32(r, 3, 5, 7)))),
        simple("eltwise_run_lstm_cell", "tanh", TRANSC, _lstm_cell_tail),
        # the recurrence in one kernel: hidden sizes off the workgroup size, several batch
        # rows, a strided x, and a hidden size past the private-rows variant of lstm.comp
        simple("lstm_odd_batched", "lstm", ACCUM, lambda b, r, i: _lstm(b, r, i, steps=9, batch=3, hidden=37)),
        simple("lstm_permuted_x", "lstm", ACCUM, lambda b, r, i: _lstm(b, r, i, steps=5, batch=2, hidden=12, permuted=True)),
        simple("lstm_wide", "lstm", ACCUM, lambda b, r, i: _lstm(b, r, i, steps=3, batch=1, hidden=300)),
    ]


def _lstm(b, r, i, steps, batch, hidden, permuted=False):
    """lstm(x, w_hh, h0, c0) with W_hh scaled like a trained layer's (1/sqrt(H)), so gates
    are not all saturated; `permuted`: x is a [B, T, 4H] input seen as [T, B, 4H] (strided)
    and W_hh an input, not a constant weight (a backend may pre-pack only the latter)."""
    shape = (batch, steps, 4 * hidden) if permuted else (steps, batch, 4 * hidden)
    x = _in(b, i, "x", f32(r, *shape))
    if permuted:
        x = b.permute(x, axes=(1, 0, 2))
    w_hh = f32(r, 4 * hidden, hidden, lo=-1.0, hi=1.0) / np.float32(np.sqrt(hidden))
    w = _in(b, i, "w_hh", w_hh) if permuted else b.weight("w_hh", w_hh)
    return b.lstm(x, w, _in(b, i, "h0", f32(r, batch, hidden, lo=-1.0, hi=1.0)),
                  _in(b, i, "c0", f32(r, batch, hidden, lo=-1.0, hi=1.0)))


def _lstm_cell_tail(b, r, i):
    """An LSTM cell after its gate matmul: slices of one gate tensor, then the cell update."""
    g, c = _in(b, i, "g", f32(r, 2, 20)), _in(b, i, "c", f32(r, 2, 5))
    sig = b.sigmoid(b.slice(g, axis=1, start=0, stop=15))
    gg = b.tanh(b.slice(g, axis=1, start=15, stop=20))
    ig, fg, og = (b.slice(sig, axis=1, start=k * 5, stop=(k + 1) * 5) for k in range(3))
    return b.mul(og, b.tanh(b.add(b.mul(fg, c), b.mul(ig, gg))))


def _with_extra_cases() -> list[Case]:
    from .cases_extra import onnx_op_cases  # late: they build on the helpers above
    from .quant_cases import quant_cases

    return _cases() + onnx_op_cases() + quant_cases()


CASES = _with_extra_cases()


def _fused_cases() -> list[Case]:
    """Chains the fusion pass merges into a fused op (flare.core.ops.fused), written unfused: a
    backend that supports the fused op must run them fused, one that does not must run
    them as built; either way they give the reference of the unfused graph."""
    def linear_chain(b, r, i):
        y = b.matmul(_in(b, i, "a", f32(r, 2, 5, 16)), b.weight("w", f32(r, 12, 16)), transpose_b=True)
        y = b.gelu(b.add(y, b.weight("bias", f32(r, 12))))
        return b.add(_in(b, i, "res", f32(r, 2, 5, 12)), y)

    def residual_chain(b, r, i):
        return b.add(b.matmul(_in(b, i, "a", f32(r, 7, 40)), b.weight("w", f32(r, 40, 130))),
                     _in(b, i, "res", f32(r, 7, 130)))

    def head_chain(b, r, i):
        y = b.matmul(_in(b, i, "a", f32(r, 1, 96)), b.weight("w", f32(r, 1, 96)), transpose_b=True)
        return b.sigmoid(b.add(y, b.weight("bias", f32(r, 1))))

    def layer_norm_chain(b, r, i):
        y = b.mul(b.layer_norm(_in(b, i, "x", f32(r, 3, 4, 32)), eps=1e-5), b.weight("g", f32(r, 32)))
        return b.add(y, b.weight("beta", f32(r, 32)))

    def rms_norm_chain(b, r, i):
        return b.mul(b.rms_norm(_in(b, i, "x", f32(r, 6, 24)), eps=1e-6), b.weight("g", f32(r, 24)))

    def attention_chain(b, r, i):
        s = b.matmul(_in(b, i, "q", f32(r, 2, 3, 5, 8)), _in(b, i, "k", f32(r, 2, 3, 7, 8)), transpose_b=True)
        p = b.softmax(s, _in(b, i, "m", np.where(r.random((2, 1, 1, 7)) < 0.3, -1e9, 0.0).astype(np.float32)), scale=0.35)
        return b.matmul(p, _in(b, i, "v", f32(r, 2, 3, 7, 6)))

    def attention_of_views(b, r, i):
        heads = [b.permute(_in(b, i, n, f32(r, 4 if n == "q" else 9, 2, 8)), axes=(1, 0, 2)) for n in ("q", "k", "v")]
        return b.matmul(b.softmax(b.matmul(heads[0], heads[1], transpose_b=True), scale=0.5), heads[2])

    def leaky_relu_chain(b, r, i):  # the ONNX importer's LeakyRelu (alpha 0.1, as HiFi-GAN decoders)
        x = _in(b, i, "x", f32(r, 3, 8, 37))
        return b.add(b.scale(x, scale=0.1), b.scale(b.relu(x), scale=0.9))

    def conv_add_chain(b, r, i):  # a 1-D residual block as imported: Conv over H = 1, reshape, skip sum
        x = _in(b, i, "x", f32(r, 2, 6, 1, 70))
        y = b.op("conv2d", x, b.weight("w", f32(r, 5, 6, 1, 7)), b.weight("bias", f32(r, 5)),
                 pads=((0, 0), (9, 9)), dilations=(1, 3))
        return b.add(_in(b, i, "res", f32(r, 2, 5, 70)), b.reshape(y, shape=(2, 5, 70)))

    def conv_add_4d(b, r, i):  # no reshape: the residual has the convolution's [B, C, 1, W]
        y = b.op("conv2d", _in(b, i, "x", f32(r, 1, 3, 1, 40)), b.weight("w", f32(r, 4, 3, 1, 3)),
                 pads=((0, 0), (1, 1)))
        return b.add(y, _in(b, i, "res", f32(r, 1, 4, 1, 40)))

    return [simple("linear_bias_gelu_residual", "linear", ACCUM, linear_chain),
            simple("linear_residual_only", "linear", ACCUM, residual_chain),
            simple("linear_bias_sigmoid", "linear", ACCUM, head_chain),
            simple("norm_affine_layer", "norm_affine", ACCUM, layer_norm_chain),
            simple("norm_affine_rms", "norm_affine", ACCUM, rms_norm_chain),
            simple("attention_mask", "attention", ACCUM, attention_chain),
            simple("attention_heads_of_views", "attention", ACCUM, attention_of_views),
            simple("leaky_relu_chain", "leaky_relu", ARITH, leaky_relu_chain),
            simple("conv_add_reshaped", "conv_add", ACCUM, conv_add_chain),
            simple("conv_add_4d", "conv_add", ACCUM, conv_add_4d)]


FUSED_CASES = _fused_cases()


def case_entry(case: Case):
    """The case as an entry builder (same seed every time, so it rebuilds the same graph)."""
    import zlib

    def entry(b: GraphBuilder, shapes) -> None:
        out, _ = case.build(b, np.random.default_rng(zlib.crc32(case.id.encode())))
        b.output("out", out)
    return entry


def case_expected(case: Case) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(inputs, the reference output) of the case."""
    import zlib

    from flare.core.reference import evaluate

    b = GraphBuilder()
    out, inputs = case.build(b, np.random.default_rng(zlib.crc32(case.id.encode())))
    b.output("out", out)
    return inputs, evaluate(b.build(), inputs)[0]["out"]
OPS_COVERED = sorted({c.op for c in CASES + FUSED_CASES})


def refused_nodes(graph, device) -> list[str]:
    """'name (op)' of every non-view node of `graph` that `device.supports` refuses.

    The one skip rule of the suite: a test whose graph has such a node skips with
    this list on a device tested alone (op and fused-chain tests); lifecycle tests
    instead run the graph with the CPU behind the device, which takes those nodes."""
    from flare.core.ops import OPS

    return [f"{n.name} ({n.op})" for n in graph.nodes if OPS[n.op].view is None and not device.supports(n)]


def _inplace_case(op: str) -> Case:
    """op applied three times, `op(op(op(x, ...)))`: the inner result is read only by the
    middle node, which has its shape and dtype and is no output, so the planner puts the
    middle result on the inner one's bytes — the kernel runs with `out` aliasing
    `srcs[0]` (docs/write-a-backend.md, "Kernel contract"). Tolerance: the op's own,
    tripled for three applications (inputs are kept where the op is well conditioned)."""
    from flare.core.ops import OPS

    arity = OPS[op].n_srcs[0]

    def build(b, rng):
        inputs: dict[str, np.ndarray] = {}
        lo, hi = {"sqrt": (0.25, 4.0), "div": (0.25, 4.0), "exp": (-1.0, 0.5)}.get(op, (-1.5, 1.5))
        x = _in(b, inputs, "x", f32(rng, 3, 5, 8, lo=lo, hi=hi))
        params = {"scale": 0.75, "bias": -0.25} if op == "scale" else {}
        if arity == 2:
            other = _in(b, inputs, "b", f32(rng, 8, lo=0.5, hi=1.5))   # broadcast row; never 0 (div)
            return b.op(op, b.op(op, b.op(op, x, other), other), other), inputs
        return b.op(op, b.op(op, b.op(op, x, **params), **params), **params), inputs

    tol = next(c.tol for c in CASES if c.op == op)
    return Case(f"{op}_in_place", op, build, (tol[0] * 3, tol[1] * 3))


def _inplace_cases() -> list[Case]:
    from flare.core.ops import OPS

    return [_inplace_case(name) for name, d in sorted(OPS.items())
            if d.inplace and not d.fused and not d.view and d.n_srcs[0] <= 2 and any(c.op == name for c in CASES)]


INPLACE_CASES = _inplace_cases()
