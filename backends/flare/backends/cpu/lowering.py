"""Nodes -> native commands: the compile step of the native CPU executor.

Each supported node becomes one or more `flare_cmd` records (see kernels.c):
kernel id, pointers into the bound arena views, a 4-D output shape and 4-D
element strides per operand (broadcast dims get stride 0, and elementwise
operands are coalesced so inner loops are long and unit-stride where memory
allows), plus the op's parameters. `translate(node, out, srcs)` returns the
records as dicts, or None when the native path does not cover that node (a
dtype, a layout BLAS cannot take): the device then runs its NumPy kernel.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from flare.core.graph import Tensor

# kernel ids: the order of the enum in kernels.c
KINDS = ("copy4 copy2 copy8 add sub mul div scale relu sigmoid silu gelu tanh exp sqrt neg sqr matmul "
         "layer_norm rms_norm softmax get_rows rope conv1d pad sum mean max argmax top_k gather mul_mat_id "
         "set_rows cast_f32_i32 cast_i32_f32 cast_f16_f32 linear norm_affine lstm "
         "qmatmul dequantize get_rows_q mul_mat_id_q leaky_relu stage_experts erf").split()
K = {name: i for i, name in enumerate(KINDS)}
ACTIVATIONS = {"none": 0, "gelu": 1, "relu": 2, "sigmoid": 3}
SMALL_GEMM = 4096      # M*N*K at or below which the plain C loop beats BLAS's dispatch
WDOT_MAX_ROWS = 16     # a [M, K] @ W^T (W stored [N, K]) streams W once up to this many rows
SWAP_MAX_ROWS = 64     # ... and runs as OpenBLAS (W a^T)^T up to this many
PACKED_MAX_ROWS = 1 << 30  # a constant weight pre-packed into panels (packing.py) up to this many rows

Cmd = dict  # kind, out, src (list of arrays or None), ne, os, ss, ip, fp, flags, scratch (bytes needed)
Translator = Callable[[Tensor, np.ndarray, Sequence[np.ndarray]], "list[Cmd] | None"]
TRANSLATORS: dict[str, Translator] = {}


def translator(*ops: str):
    def deco(fn: Translator) -> Translator:
        for op in ops:
            TRANSLATORS[op] = fn
        return fn
    return deco


def translate(node: Tensor, out: np.ndarray, srcs: Sequence[np.ndarray]) -> list[Cmd] | None:
    fn = TRANSLATORS.get(node.op)
    return fn(node, out, srcs) if fn is not None else None


# -- layout helpers ------------------------------------------------------------
def estrides(a: np.ndarray) -> list[int]:
    return [s // a.itemsize for s in a.strides]


def pad4(values: Sequence[int], fill: int) -> list[int]:
    values = list(values)
    return [fill] * (4 - len(values)) + values


def bcast4(a: np.ndarray, out_shape: Sequence[int]) -> list[int]:
    """a's element strides aligned right to `out_shape` (4-D), 0 where a is broadcast."""
    pad, item = 4 - a.ndim, a.itemsize
    opad = 4 - len(out_shape)
    st = [0] * pad + [s // item for s in a.strides]
    shape = (1,) * pad + a.shape
    oshape = (1,) * opad + tuple(out_shape)
    return [0 if shape[i] == 1 and oshape[i] != 1 else st[i] for i in range(4)]


def coalesce(shape: Sequence[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that are contiguous in every operand."""
    dims = [(d, [s[i] for s in strides]) for i, d in enumerate(shape) if d != 1]
    merged: list[tuple[int, list[int]]] = []
    for d, st in dims:
        if merged:
            pd, pst = merged[-1]
            if all(ps == s * d for ps, s in zip(pst, st)):
                merged[-1] = (pd * d, st)
                continue
        merged.append((d, st))
    while len(merged) > 4:  # cannot happen for rank <= 4, kept for safety
        return list(pad4(shape, 1)), strides
    shape4 = pad4([d for d, _ in merged], 1)
    out = [pad4([st[k] for _, st in merged], 0) for k in range(len(strides))]
    return shape4, out


def ptr(a: np.ndarray | None) -> int:
    return 0 if a is None else a.ctypes.data


def cmd(kind: str, out: np.ndarray, srcs: Sequence[np.ndarray | None], ne, os_, ss, ip=(), fp=(), flags=0,
        scratch=0) -> Cmd:
    return {"kind": K[kind], "out": out, "src": list(srcs), "ne": list(ne), "os": list(os_),
            "ss": [list(s) for s in ss], "ip": list(ip), "fp": list(fp), "flags": flags, "scratch": scratch}


def _f32(*arrays: np.ndarray) -> bool:
    return all(a.dtype == np.float32 for a in arrays)


# -- elementwise ------------------------------------------------------------------
_FLAT = [0, 0, 0, 1]


def elementwise(kind: str, out: np.ndarray, srcs: Sequence[np.ndarray], fp=()) -> Cmd:
    if out.size > 1 and out.flags.c_contiguous and all(s.shape == out.shape and s.flags.c_contiguous for s in srcs):
        # every operand contiguous, none broadcast: what coalesce makes of it (one run of size
        # elements), without it (most of an audio decoder's commands; a new plan per length
        # translates them all again)
        return cmd(kind, out, srcs, [1, 1, 1, out.size], _FLAT, [_FLAT] * len(srcs), fp=fp)
    shape, st = coalesce(pad4(out.shape, 1), [pad4(estrides(out), 0)] + [bcast4(s, out.shape) for s in srcs])
    return cmd(kind, out, srcs, shape, st[0], st[1:], fp=fp)


@translator("add", "sub", "mul", "div")
def _binary(node, out, srcs):
    return [elementwise(node.op, out, srcs)] if _f32(out, *srcs) else None


@translator("relu", "sigmoid", "silu", "gelu", "tanh", "exp", "sqrt", "neg", "sqr", "erf")
def _unary(node, out, srcs):
    return [elementwise(node.op, out, srcs)] if _f32(out, *srcs) else None


@translator("scale")
def _scale(node, out, srcs):
    return [elementwise("scale", out, srcs, fp=(node.params["scale"], node.params["bias"]))] if _f32(out, *srcs) else None


@translator("leaky_relu")
def _leaky_relu(node, out, srcs):
    """The fused LeakyRelu chain: one pass, x > 0 ? x : alpha*x."""
    return [elementwise("leaky_relu", out, srcs, fp=(node.params["alpha"],))] if _f32(out, *srcs) else None


_COPY = {2: "copy2", 4: "copy4", 8: "copy8"}


def copy(out: np.ndarray, src: np.ndarray) -> Cmd | None:
    if out.dtype != src.dtype or out.itemsize not in _COPY or out.shape != src.shape:
        return None
    return elementwise(_COPY[out.itemsize], out, [src])


@translator("contiguous")
def _contiguous(node, out, srcs):
    c = copy(out, srcs[0])
    return [c] if c else None


@translator("concat")
def _concat(node, out, srcs):
    axis = node.params["axis"] % out.ndim
    n0 = srcs[0].shape[axis]
    lo = [slice(None)] * out.ndim
    hi = [slice(None)] * out.ndim
    lo[axis], hi[axis] = slice(0, n0), slice(n0, None)
    cmds = [copy(out[tuple(lo)], srcs[0]), copy(out[tuple(hi)], srcs[1])]
    return cmds if all(cmds) else None


@translator("copy_into")
def _copy_into(node, out, srcs):
    src = srcs[1]
    if not out.flags.c_contiguous or out.dtype != src.dtype:
        return None
    off = node.params["offset"]
    c = copy(out.reshape(-1)[off: off + src.size].reshape(src.shape), src)
    return [c] if c else None


@translator("cast")
def _cast(node, out, srcs):
    src = srcs[0]
    if out.dtype == src.dtype:
        c = copy(out, src)
        return [c] if c else None
    kind = {("float32", "int32"): "cast_f32_i32", ("int32", "float32"): "cast_i32_f32",
            ("float16", "float32"): "cast_f16_f32"}.get((src.dtype.name, out.dtype.name))
    return [elementwise(kind, out, [src])] if kind else None


# -- matmul ------------------------------------------------------------------------
def gemm_operand(rows: int, cols: int, s_rows: int, s_cols: int) -> tuple[int, int] | None:
    """(transpose flag, leading dim) for a row-major BLAS operand of logical shape [rows, cols]."""
    if (cols == 1 or s_cols == 1) and (rows == 1 or s_rows >= cols) and s_rows != 0:
        return 111, (s_rows if rows > 1 else max(cols, 1))
    if (rows == 1 or s_rows == 1) and (cols == 1 or s_cols >= rows) and s_cols != 0:
        return 112, (s_cols if cols > 1 else max(rows, 1))
    return None


def matmul_cmd(kind: str, node: Tensor, out: np.ndarray, a: np.ndarray, b: np.ndarray,
               rows: Sequence[np.ndarray] = ()) -> Cmd | None:
    """K_MATMUL (or K_LINEAR) operands: out [.., M, N] = a [.., M, K] @ b, b logical [.., K, N]."""
    if not _f32(out, a, b) or out.ndim < 2 or out.strides[-1] != out.itemsize or out.ndim > 4:
        return None
    if node.params.get("transpose_b"):
        b = np.swapaxes(b, -1, -2)
    m, k = a.shape[-2:]
    n = b.shape[-1]
    oshape = out.shape
    ost = pad4(estrides(out), 0)
    ast = bcast4(a, (*oshape[:-2], m, k))
    bst = bcast4(b, (*oshape[:-2], k, n))
    if ost[2] < n and m > 1:
        return None
    ta = gemm_operand(m, k, ast[2], ast[3])
    tb = gemm_operand(k, n, bst[2], bst[3])
    if ta is None or tb is None:
        return None
    ne = pad4(oshape, 1)
    if (bst[0] == bst[1] == 0 and ta[0] == 111 and _rows_fold(ne, ast, m) and _rows_fold(ne, ost, m)
            and all(_rows_fold(ne, bcast4(r, oshape), m) for r in rows)):
        # b is shared by every batch and a's rows follow one another: one GEMM with more rows
        m = ne[0] * ne[1] * m
        ne = [1, 1, m, n]
    route = _route(m, n, k, ta, tb, ast, bst)
    return cmd(kind, out, [a, b], ne, ost, [ast, bst], ip=(m, n, k, ta[0], ta[1], tb[0], tb[1], route),
               scratch=m * n * 4 if route == R_SWAP else 0)


R_GEMM, R_GEMV_T, R_GEMV_N, R_WDOT, R_SWAP, R_SMALL, R_PACKED, R_IDOT, R_ICHAIN = range(9)  # kernels.c's enum


def prepackable(c: Cmd, w: np.ndarray) -> bool:
    """Whether matmul/linear command c (right operand w, a constant weight stored [N, K]) should
    run the packed microkernel instead: a route that reads w as [N, K] rows, w shared by every batch."""
    if c["kind"] != K["matmul"] and c["kind"] != K["linear"]:
        return False
    m, n, k = c["ip"][0], c["ip"][1], c["ip"][2]
    return (c["ip"][7] in (R_WDOT, R_SWAP, R_GEMM, R_IDOT) and c["ip"][5] == 112 and c["ss"][1][2] == 1
            and c["ss"][1][0] == c["ss"][1][1] == 0 and w.ndim == 2 and w.shape == (n, k)
            and w.strides[1] == 4 and c["ip"][3] == 111 and c["ss"][0][3] == 1 and 1 <= m <= PACKED_MAX_ROWS)


def use_packed(c: Cmd, packed: np.ndarray) -> None:
    """Point c at the packed copy of its weight (R_PACKED needs no scratch)."""
    c["src"][1] = packed
    c["ip"][7] = R_PACKED
    c["scratch"] = 0


def _route(m: int, n: int, k: int, ta, tb, ast, bst) -> int:
    """Which matmul kernel. Batch-invariant by default: the choice does not depend on the row
    count m, and each kernel computes an output element by one formula of its a-row and b-column
    (kernels.c: idot when both read k with unit stride, else ichain; a constant weight is then
    pre-packed, for every m, and the packed microkernel is one FMA chain per element too), so a
    row's result does not depend on how many rows share the step (decode vs batch vs prefill
    chunk vs speculative verify). FLARE_CPU_MATMUL=fastest restores the per-shape routes below
    (BLAS sgemm/sgemv, wdot, swap, the small loop), measured on this project's shapes."""
    if matmul_policy() == "invariant":
        return R_IDOT if ast[3] == 1 and bst[2] == 1 else R_ICHAIN   # by strides alone, never by m
    weight_t = tb[0] == 112 and bst[2] == 1          # b stored [N, K] with unit k stride
    if m * n * k <= SMALL_GEMM and (bst[3] == 1 or bst[2] == 1):
        return R_SMALL
    if m == 1 and ast[3] != 0:
        return R_GEMV_T if tb[0] == 112 else R_GEMV_N
    if ta[0] == 111 and ast[3] == 1 and weight_t:
        if m <= WDOT_MAX_ROWS:
            return R_WDOT
        if m <= SWAP_MAX_ROWS:
            return R_SWAP
    return R_GEMM


# FLARE_CPU_MATMUL: "invariant" (the default: a row's result independent of the step's row count,
# see _route) or "fastest" (the per-shape routes, including BLAS; results may differ in the last
# bits between a row computed alone and in a batch). Read when a split is compiled.
MATMUL_POLICIES = ("invariant", "fastest")


def matmul_policy() -> str:
    import os
    value = (os.environ.get("FLARE_CPU_MATMUL") or "invariant").strip().lower()
    return value if value in MATMUL_POLICIES else "invariant"


def _rows_fold(ne: list[int], st: list[int], m: int) -> bool:
    """Whether batch dims (ne[0], ne[1]) continue the row stride st[2] (so rows can be merged)."""
    return ((ne[1] == 1 or st[1] == m * st[2]) and (ne[0] == 1 or st[0] == ne[1] * m * st[2]))


@translator("matmul")
def _matmul(node, out, srcs):
    if srcs[1].dtype.names:
        return _qmatmul(node, out, srcs)
    c = matmul_cmd("matmul", node, out, *srcs)
    return [c] if c else None


# -- block-quantized weights (quant.c) --------------------------------------------------
def _quant(w: np.ndarray) -> tuple[int, int, int, int] | None:
    """(ggml type, K, bytes per weight row, bytes per activation row) of contiguous rows of blocks."""
    from flare.core.dtypes import QUANT_TYPES, from_numpy

    from .native import load
    t = QUANT_TYPES[from_numpy(w.dtype)]
    native = load()   # translators run only for the native executor, so it is loaded
    if w.strides[-1] != w.itemsize or native is None:
        return None
    k = w.shape[-1] * t.block_size
    act = native.lib.flare_qact_row_bytes(t.ggml_type, k)   # quant.c's activation block layout
    return t.ggml_type, k, w.strides[-2] if w.ndim > 1 else w.nbytes, act


# Which activations quantized products take: "integer" (the default) rounds each block of them
# for integer dot products: to 16 bits per block of 32 for q4_0/q4_1/q8_0 (error ~1e-5 of the
# block's largest value: the dequantized-weights reference to KL ~4e-8), to 8 bits per block of
# 256 for q4_k/q6_k (ggml's scheme, ~0.4% noise per output, see quant_cases.QUANT_DOT); "float"
# dequantizes each weight row and multiplies in float (no rounding at all, slow at decode).
# FLARE_CPU_QUANT_ACTIVATIONS chooses (read when a split is compiled; "int8" and "int16", the
# names of earlier versions, mean "integer"); figures in backends/flare/backends/cpu/README.md.
QUANT_ACTIVATIONS = ("integer", "float")
_ALIASES = {"int8": "integer", "int16": "integer", "int": "integer"}


def quant_activations(setting: str | None) -> str:
    import os
    value = (setting or os.environ.get("FLARE_CPU_QUANT_ACTIVATIONS") or "integer").strip().lower()
    value = _ALIASES.get(value, value)
    return value if value in QUANT_ACTIVATIONS else "integer"


def _float_activations(k: int) -> bool:
    return quant_activations(None) == "float" and k <= 65536


def _qmatmul(node, out, srcs):
    a, w = srcs
    q = _quant(w)
    if (q is None or w.ndim != 2 or not node.params["transpose_b"] or not _f32(out, a)
            or out.ndim > 4 or not out.flags.c_contiguous or a.strides[-1] != 4):
        return None
    qtype, k, wrb, xrb = q
    m, n = out.shape[-2:]
    ast = bcast4(a, (*out.shape[:-2], m, k))
    rows = int(np.prod(out.shape[:-1]))   # every activation row of every batch, quantized once
    fp = _float_activations(k)
    return [cmd("qmatmul", out, [a, w], pad4(out.shape, 1), pad4(estrides(out), 0), [ast],
                ip=(qtype, k, wrb, xrb, int(fp)), scratch=0 if fp else rows * xrb)]


@translator("dequantize")
def _dequantize(node, out, srcs):
    (w,) = srcs
    q = _quant(w)
    if q is None or not out.flags.c_contiguous or not w.flags.c_contiguous:
        return None
    qtype, k, wrb, _ = q
    rows = out.size // k
    return [cmd("dequantize", out, [w], [1, 1, rows, k], [0, 0, k, 1], [], ip=(qtype, k, wrb))]


@translator("linear")
def _linear(node, out, srcs):
    p = node.params
    bias = srcs[2] if p["has_bias"] else None
    res = srcs[-1] if p["has_residual"] else None
    if not _f32(*[s for s in (bias, res) if s is not None]):
        return None
    c = matmul_cmd("linear", node, out, srcs[0], srcs[1], rows=[res] if res is not None else [])
    if c is None:
        return None
    c["src"] += [bias, res]
    c["ss"] += [bcast4(bias, out.shape) if bias is not None else [0] * 4,
                bcast4(res, out.shape) if res is not None else [0] * 4]
    c["flags"] = ACTIVATIONS[p["act"]]
    return [c]


# -- rows -----------------------------------------------------------------------------
def rows_cmd(kind: str, out: np.ndarray, srcs: Sequence[np.ndarray | None], fp=(), flags=0) -> Cmd:
    return cmd(kind, out, srcs, pad4(out.shape, 1), pad4(estrides(out), 0),
               [bcast4(s, out.shape) if s is not None else [0] * 4 for s in srcs], fp=fp, flags=flags)


@translator("layer_norm", "rms_norm")
def _norm(node, out, srcs):
    return [rows_cmd(node.op, out, srcs, fp=(node.params["eps"],))] if _f32(out, *srcs) else None


@translator("norm_affine")
def _norm_affine(node, out, srcs):
    if not _f32(out, *srcs):
        return None
    beta = srcs[2] if node.params["has_beta"] else None
    return [rows_cmd("norm_affine", out, [srcs[0], srcs[1], beta], fp=(node.params["eps"],),
                     flags=int(node.params["norm"] == "layer"))]


@translator("softmax")
def _softmax(node, out, srcs):
    if not _f32(out, *srcs):
        return None
    return [rows_cmd("softmax", out, [srcs[0], srcs[1] if len(srcs) > 1 else None], fp=(node.params["scale"],))]


# -- indexing -----------------------------------------------------------------------------
@translator("get_rows")
def _get_rows(node, out, srcs):
    table, idx = srcs
    if table.dtype.names:
        q = _quant(table)
        if q is None or not out.flags.c_contiguous:
            return None
        ist = [0] * (3 - idx.ndim) + estrides(idx) + [0]
        return [cmd("get_rows_q", out, [table, idx], pad4(out.shape, 1), pad4(estrides(out), 0), [[0, 0, 0, 0], ist],
                    ip=(q[0], q[1], q[2], 0, table.shape[0], int(idx.dtype == np.int64)))]
    if table.dtype not in (np.float32, np.float16) or out.dtype != np.float32:
        return None
    tst = estrides(table)
    ist = [0] * (3 - idx.ndim) + estrides(idx) + [0]
    return [cmd("get_rows", out, [table, idx], pad4(out.shape, 1), pad4(estrides(out), 0),
                [[0, 0, tst[0], tst[1]], ist], ip=(table.shape[0], int(idx.dtype == np.int64), int(table.dtype == np.float16)))]


@translator("rope")
def _rope(node, out, srcs):
    x, pos = srcs
    if not _f32(out, x):
        return None
    return [cmd("rope", out, [x, pos], pad4(out.shape, 1), pad4(estrides(out), 0),
                [pad4(estrides(x), 0), [0, estrides(pos)[0], 0, 0]],
                ip=(int(bool(node.params["neox"])),), fp=(node.params["base"],))]


@translator("gather")
def _gather(node, out, srcs):
    x, idx = srcs
    if not _f32(out, x):
        return None
    return [cmd("gather", out, [x, idx], pad4(out.shape, 1), pad4(estrides(out), 0),
                [pad4(estrides(x), 0), pad4(estrides(idx), 0)], ip=(x.shape[-1],))]


@translator("set_rows")
def _set_rows(node, out, srcs):
    dst, idx, src = srcs
    if not _f32(out, src) or not out.flags.c_contiguous:
        return None
    return [cmd("set_rows", out, [None, idx, src], [1, 1, src.shape[0], src.shape[1]], [0, 0, out.shape[1], 1],
                [[0] * 4, [0, 0, estrides(idx)[0], 0], [0, 0, *estrides(src)]], ip=(out.shape[0],))]


# -- reductions ------------------------------------------------------------------------------
def _moved(x: np.ndarray, axis: int) -> tuple[list[int], list[int], int, int]:
    """Outer shape (3-D) and strides with `axis` removed, plus its length and stride."""
    shape, st = list(x.shape), estrides(x)
    n, s = shape.pop(axis), st.pop(axis)
    return [1] * (3 - len(shape)) + shape, [0] * (3 - len(st)) + st, n, s


@translator("sum", "mean", "max", "argmax")
def _reduce(node, out, srcs):
    x = srcs[0]
    if x.dtype != np.float32 or not out.flags.c_contiguous:
        return None
    outer, st, n, s = _moved(x, node.params["axis"] % x.ndim)
    ost = []
    acc = 1
    for d in reversed(outer):
        ost.insert(0, acc)
        acc *= d
    return [cmd(node.op, out, [x], [*outer, 1], [*ost, 0], [[*st, s]], ip=(n,))]


@translator("top_k")
def _top_k(node, out, srcs):
    x = srcs[0]
    if x.dtype != np.float32:
        return None
    return [cmd("top_k", out, [x], pad4(out.shape, 1), pad4(estrides(out), 0), [pad4(estrides(x), 0)],
                ip=(x.shape[-1],))]


# -- conv, pad, experts ----------------------------------------------------------------------------
CONV1D_BLOCK, CONV1D_SLOTS = 65536, 8  # as native/conv1d.h


CONV1D_ROWS_LOUT = 64  # outputs this short take conv1d.h's row layout (one product over every batch)


def conv1d_rows(lout: int) -> int:
    """ip[6] of the conv1d command: 1 for the row layout (short outputs, see native/conv1d.h)."""
    return int(lout <= CONV1D_ROWS_LOUT)


def conv1d_direct(k: int, stride: int, pad: int, length: int, lout: int, x_row: int, x_step: int) -> int:
    """ip[7] of the conv1d command: 1 where the column-block layout reads x in place (a pointwise
    convolution, output as long as x, over rows of unit stride that do not overlap: x's rows are
    the im2col rows; see native/conv1d.h). `x_row`/`x_step`: x's element strides over Cin and L."""
    return int(k == 1 and stride == 1 and pad == 0 and lout == length and x_step == 1 and x_row >= length
               and not conv1d_rows(lout))


def conv1d_scratch(b: int, cin: int, k: int, lout: int, cout: int, direct: int = 0) -> int:
    """Bytes of the conv1d command's scratch, as native/conv1d.h uses it: for the row layout the
    im2col rows and the product ([B*Lout, Cin*K] and [B*Lout, Cout] floats); none where x is read
    in place (`conv1d_direct`); otherwise one im2col block (ck x n floats) per slot (one block
    when the whole im2col is under 1 MiB)."""
    ck = cin * k
    if conv1d_rows(lout):
        return b * lout * (ck + cout) * 4
    if direct:
        return 0
    if ck * lout <= 4 * CONV1D_BLOCK:
        n = max(lout, 1)
    else:
        n = min(max(CONV1D_BLOCK // max(ck, 1), 256), 4096) & ~15
    blocks = b * -(-lout // n)
    return min(blocks, CONV1D_SLOTS) * ck * n * 4


@translator("conv1d")
def _conv1d(node, out, srcs):
    x, w = srcs
    if not _f32(out, x, w) or not w.flags.c_contiguous or not out.flags.c_contiguous:
        return None
    b, cin, length = x.shape
    cout, _, k = w.shape
    lout = out.shape[2]
    p = node.params
    xs = estrides(x)
    direct = conv1d_direct(k, p["stride"], p["padding"], length, lout, xs[1], xs[2])
    return [cmd("conv1d", out, [x, w], [1, b, cout, lout], [0, *estrides(out)], [[0, *xs]],
                ip=(p["stride"], p["padding"], p["dilation"], cin, k, length, conv1d_rows(lout), direct),
                scratch=conv1d_scratch(b, cin, k, lout, cout, direct))]


CONV1D_PACKED = 2  # flags bit of a conv1d command whose src[1] is the packed weight (conv1d.h)
CONV1D_RESIDUAL = 4  # flags bit of a conv1d command whose output starts from src[3] (fused conv_add)
CONV1D_WINO = 8  # flags bit of a conv1d command on the Winograd path: src[1] is U = G w, ip[7] its slots


def conv_prepackable(c: Cmd, w: np.ndarray) -> bool:
    """Whether conv1d command c (weight w [Cout, Cin, K], a constant) should multiply by the packed
    copy of w as [Cout, Cin*K]: the row layout's product (conv1d.h, ip[6]) over more than 16 rows
    (up to 16 run wdot by output channels)."""
    return (c["kind"] == K["conv1d"] and len(c["ip"]) > 6 and c["ip"][6] == 1 and c["ne"][1] * c["ne"][3] > 16
            and w.ndim == 3 and w.flags.c_contiguous and w.dtype == np.float32)


def use_packed_conv(c: Cmd, packed: np.ndarray) -> None:
    """Point conv1d command c at the packed copy of its weight."""
    c["src"][1] = packed
    c["flags"] = int(c["flags"]) | CONV1D_PACKED


@translator("lstm")
def _lstm(node, out, srcs):
    x, w, h0, c0 = srcs
    if not _f32(out, *srcs) or not w.flags.c_contiguous or not out.flags.c_contiguous:
        return None
    steps, batch, _ = x.shape
    hidden = w.shape[1]
    return [cmd("lstm", out, [x, w, h0, c0], [1, steps, batch, 2 * hidden], [0, *estrides(out)],
                [[0, *estrides(x)], [0, 0, *estrides(h0)], [0, 0, *estrides(c0)]], ip=(hidden, 0),
                scratch=(batch * 6 + 4) * hidden * 4)]


def use_packed_lstm(c: Cmd, packed: np.ndarray) -> None:
    """Point lstm command c at the packed panels of its W_hh (ip[1] = 1: pgemm per step)."""
    c["src"][1] = packed
    c["ip"][1] = 1


@translator("pad")
def _pad(node, out, srcs):
    x = srcs[0]
    if not _f32(out, x):
        return None
    lo = pad4([lo for lo, _ in node.params["pads"]], 0)
    return [cmd("pad", out, [x], pad4(out.shape, 1), pad4(estrides(out), 0), [pad4(estrides(x), 0)],
                ip=(*lo, *pad4(x.shape, 1)), fp=(node.params["value"],), flags=int(node.params["mode"] == "reflect"))]


@translator("mul_mat_id")
def _mul_mat_id(node, out, srcs):
    w, x, ids = srcs
    if w.dtype.names:
        q = _quant(w)
        if q is None or not _f32(out, x) or x.strides[-1] != 4 or not out.flags.c_contiguous:
            return None
        t, kk = ids.shape
        fp = _float_activations(q[1])
        xst = estrides(x)
        xs = [0, xst[0], 0, 1] if x.ndim == 2 else [0, xst[0], xst[1], 1]
        return [cmd("mul_mat_id_q", out, [w, x, ids], [1, t, kk, out.shape[-1]], [0, *estrides(out)],
                    [[0, 0, 0, 0], xs, [0, *estrides(ids), 0]],
                    ip=(q[0], q[1], q[2], q[3], w.shape[0], int(fp), w.strides[0]), scratch=0 if fp else t * kk * q[3])]
    if not _f32(out, w, x) or w.strides[2] != 4 or x.strides[-1] != 4 or not out.flags.c_contiguous:
        return None
    e, n, k = w.shape
    t, kk = ids.shape
    xst = estrides(x)
    xs = [0, xst[0], 0, 1] if x.ndim == 2 else [0, xst[0], xst[1], 1]
    return [cmd("mul_mat_id", out, [w, x, ids], [1, t, kk, n], [0, *estrides(out)],
                [[0, *estrides(w)], xs, [0, *estrides(ids), 0]], ip=(e, n, k),
                scratch=t * kk * (k + n + 1) * 4 + (2 * e + 2) * 4)]  # + off [E + 2], used [E] (kernels.c)
