"""Lowering graph nodes to shader dispatches: which shader, which constants, which descriptors.

A `Dispatch` is everything `split.py` needs to record one vkCmdDispatch: the shader and
its specialization constants (MODE + dtypes), the tensors bound to bindings 1..n (each
with the descriptor the shader reads: element offset, shape[4], strides[4]), extra
parameter words, the workgroup grid, and the byte ranges it reads and writes (for
barriers). Layout tricks happen here, on the host, so shaders stay generic:
broadcasting is stride 0, `transpose_b` swaps two strides, a reduction axis is moved
last by permuting strides.

`supports(node, device)` answers from the same tables: an op with a lowering and
dtypes its shader reads.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from flare.core.backend import Binding, SplitProgram
from flare.core.dtypes import is_quant
from flare.core.graph import Tensor, contiguous_strides

from . import variants

DT = {"f32": 0, "f16": 1, "i32": 2, "i64": 3}
FLOAT_IN = ("f32", "f16", "i32")  # dtypes a float-computing shader may read
INDEX = ("i32", "i64")
ANY = ("f32", "f16", "i32", "i64")
# ggml's block types -> quant.glsl's QT (specialization constant 9 of the quantized-weight shaders)
QT = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "q4_k": 3, "q6_k": 4}
QUANT = tuple(QT)
QSUB = {"q6_k": 16}  # weights per scale (sub-block), 32 for the others
VIEW_OPS = ("reshape", "permute", "transpose", "slice")
UNARY = {"relu": 11, "gelu": 12, "silu": 13, "sigmoid": 14, "tanh": 15, "exp": 16, "sqrt": 17, "neg": 18, "sqr": 19}
BINARY = {"add": 0, "sub": 1, "mul": 2, "div": 3}
REDUCE = {"sum": 0, "mean": 1, "max": 2, "argmax": 3}
ROW_OPS = ("layer_norm", "rms_norm", "softmax", "top_k", *REDUCE)  # one workgroup per row (wg_reduce.glsl)
ELT_WG = 256
MAX_ELEMENTS = 1 << 31
SUBGROUP_ARITHMETIC = 0x4  # VK_SUBGROUP_FEATURE_ARITHMETIC_BIT: matvec and row reductions need it


def f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


def u32(value: int) -> int:
    return int(value) & 0xFFFFFFFF


@dataclass
class TensorArg:
    """One bound tensor as a shader sees it."""

    binding: Binding
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    elem_offset: int

    def words(self) -> list[int]:
        pad = 4 - len(self.shape)
        shape = (1,) * pad + tuple(self.shape)
        strides = (0,) * pad + tuple(self.strides)
        return [u32(self.elem_offset)] + [u32(d) for d in shape] + [u32(s) for s in strides]

    def byte_range(self) -> tuple[int, int]:
        item = self.binding.itemsize
        base = self.elem_offset if is_quant(self.binding.dtype) else self.elem_offset * item
        if any(d == 0 for d in self.shape):
            return base, base
        lo = hi = 0
        for d, s in zip(self.shape, self.strides):
            if s >= 0:
                hi += (d - 1) * s
            else:
                lo += (d - 1) * s
        return base + lo * item, base + (hi + 1) * item


@dataclass
class Dispatch:
    node: str
    shader: str
    spec: tuple[int, ...]
    args: list[TensorArg]
    params: list[int]
    groups: tuple[int, int, int]
    writes: list[int] = field(default_factory=list)  # indices into args that the shader writes
    buffers: list[Any] | None = None  # bindings 1..n when not one per arg (eltwise_chain)

    def bound(self) -> list[Any]:
        """The flare Buffers bound to bindings 1..n."""
        return self.buffers if self.buffers is not None else [a.binding.buffer for a in self.args]

    def meta_words(self) -> list[int]:
        out: list[int] = []
        for a in self.args:
            out += a.words()
        return out + [u32(p) for p in self.params]


class Unsupported(Exception):
    """This node cannot run on this device (the scheduler should place it elsewhere)."""


# -- descriptors ------------------------------------------------------------------------

def elem_offset(b: Binding) -> int:
    """The descriptor's offset word: in elements, but in *bytes* for block-quantized weights (a
    planner's arena need not place them at a multiple of 18 or 34 bytes; quant.glsl needs an
    even offset, as every field of every block type sits at an even byte)."""
    if is_quant(b.dtype):
        if b.offset % 2:
            raise Unsupported(f"quantized weights at the odd byte offset {b.offset}")
        return b.offset
    item = b.itemsize
    if b.offset % item:
        raise Unsupported(f"byte offset {b.offset} is not a multiple of the {b.dtype} item size")
    return b.offset // item


def arg(b: Binding, shape: Sequence[int] | None = None, strides: Sequence[int] | None = None, extra: int = 0) -> TensorArg:
    return TensorArg(b, tuple(b.shape if shape is None else shape), tuple(b.strides if strides is None else strides),
                     elem_offset(b) + extra)


def arg4(b: Binding) -> TensorArg:
    """`b` as the shader sees it: right-aligned to rank 4 (leading dims 1, stride 0)."""
    pad = 4 - len(b.shape)
    return arg(b, (1,) * pad + tuple(b.shape), (0,) * pad + tuple(b.strides))


def broadcast_to(b: Binding, shape: Sequence[int]) -> TensorArg:
    """`b` seen with the output's shape: missing and size-1 axes get stride 0."""
    rank = len(shape)
    pad = rank - len(b.shape)
    src_shape = (1,) * pad + tuple(b.shape)
    src_strides = (0,) * pad + tuple(b.strides)
    strides = tuple(0 if sd == 1 and od != 1 else st for sd, st, od in zip(src_shape, src_strides, shape))
    return arg(b, tuple(shape), strides)


def grid(n_groups: int, device: Any) -> tuple[int, int, int]:
    """A 2-D grid of n_groups workgroups (shaders fold y back in with group_linear())."""
    n_groups = max(int(n_groups), 1)
    max_x, max_y, _ = device.info.max_workgroup_count
    gx = min(n_groups, max_x)
    gy = -(-n_groups // gx)
    if gy > max_y:
        raise Unsupported(f"{n_groups} workgroups exceed the device's grid")
    return gx, gy, 1


def elementwise_grid(n: int, device: Any) -> tuple[int, int, int]:
    return grid(-(-n // ELT_WG), device)


# -- lowerings ------------------------------------------------------------------------------

Lower = Callable[[Tensor, SplitProgram, Any], list[Dispatch]]
LOWER: dict[str, Lower] = {}


def lowering(*names: str):
    def deco(fn: Lower) -> Lower:
        for n in names:
            LOWER[n] = fn
        return fn
    return deco


def _b(program: SplitProgram, t: Tensor) -> Binding:
    return program.bindings[t.id]


def _spec(mode: int, *dtypes: str) -> tuple[int, ...]:
    return (mode,) + tuple(DT[d] for d in dtypes) + (0,) * (4 - len(dtypes))


def _numel(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def _copy_dispatch(name: str, src: Binding, out: Binding, device: Any, *, out_extra: int = 0) -> Dispatch:
    """Strided copy (or cast) of `src` into contiguous memory at `out` (+ out_extra elements)."""
    n = _numel(src.shape)
    to = arg(out, src.shape, contiguous_strides(src.shape), extra=out_extra)
    return Dispatch(name, "copy", _spec(0, src.dtype, src.dtype, out.dtype), [arg(src), arg(src), to], [],
                    elementwise_grid(n, device), writes=[2])


def _same_place(a: Binding, b: Binding) -> bool:
    return a.buffer is b.buffer and a.offset == b.offset


@lowering(*VIEW_OPS)
def _view(node: Tensor, program: SplitProgram, device: Any) -> list[Dispatch]:
    return []  # the planner binds a view's output as an alias of its source


@lowering(*BINARY)
def _binary(node, program, device):
    a, b = (_b(program, s) for s in node.srcs)
    out = _b(program, node)
    ta, tb = broadcast_to(a, out.shape), broadcast_to(b, out.shape)
    return [Dispatch(node.name, "eltwise", _spec(BINARY[node.op], a.dtype, b.dtype, out.dtype) + (_flat(out, ta, tb),),
                     [ta, tb, arg(out)], [], elementwise_grid(_numel(out.shape), device), writes=[2])]


def _flat(out: Binding, *srcs: TensorArg) -> int:
    """eltwise.comp's FLAT bits: which sources are laid out exactly like the (contiguous) output."""
    strides = contiguous_strides(tuple(out.shape))
    return sum(1 << i for i, t in enumerate(srcs) if tuple(t.strides) == strides or _numel(out.shape) <= 1)


@lowering("scale", "leaky_relu", *UNARY)
def _unary(node, program, device):
    a = _b(program, node.srcs[0])
    out = _b(program, node)
    if node.op == "scale":
        mode, params = 10, [f32_bits(node.params.get("scale", 1.0)), f32_bits(node.params.get("bias", 0.0))]
    elif node.op == "leaky_relu":  # the chain's two factors (flare.core.ops.fused), one pass
        alpha = float(node.params["alpha"])
        mode, params = 20, [f32_bits(alpha), f32_bits(1.0 - alpha)]
    else:
        mode, params = UNARY[node.op], []
    ta = broadcast_to(a, out.shape)
    return [Dispatch(node.name, "eltwise", _spec(mode, a.dtype, a.dtype, out.dtype) + (_flat(out, ta, ta),),
                     [ta, ta, arg(out)], params, elementwise_grid(_numel(out.shape), device), writes=[2])]


@lowering("contiguous", "cast")
def _contiguous(node, program, device):
    return [_copy_dispatch(node.name, _b(program, node.srcs[0]), _b(program, node), device)]


@lowering("copy_into")
def _copy_into(node, program, device):
    dst, src = (_b(program, s) for s in node.srcs)
    out = _b(program, node)
    pre = [] if _same_place(dst, out) else [_copy_dispatch(node.name + ":dst", dst, out, device)]
    return pre + [_copy_dispatch(node.name, src, out, device, out_extra=int(node.params.get("offset", 0)))]


@lowering("concat")
def _concat(node, program, device):
    a, b = (_b(program, s) for s in node.srcs)
    out = _b(program, node)
    rank = len(out.shape)
    axis = int(node.params["axis"]) % rank + (4 - rank)
    return [Dispatch(node.name, "copy", _spec(1, a.dtype, b.dtype, out.dtype), [arg(a), arg(b), arg(out)], [axis],
                     elementwise_grid(_numel(out.shape), device), writes=[2])]


@lowering("pad")
def _pad(node, program, device):
    x = _b(program, node.srcs[0])
    out = _b(program, node)
    pads = [tuple(p) for p in node.params["pads"]]
    before = [0] * (4 - len(pads)) + [int(p[0]) for p in pads]
    mode = node.params.get("mode", "constant")
    if mode not in ("constant", "reflect"):
        raise Unsupported(f"pad mode {mode!r}")
    params = before + [1 if mode == "reflect" else 0, f32_bits(node.params.get("value", 0.0))]
    return [Dispatch(node.name, "copy", _spec(2, x.dtype, x.dtype, out.dtype), [arg(x), arg(x), arg(out)], params,
                     elementwise_grid(_numel(out.shape), device), writes=[2])]


MMID_TILED_MIN_PAIRS = 32  # mul_mat_id with at least this many (token, slot) pairs runs tiled, per expert
MATVEC_MAX_ROWS = 4  # at most this many rows on one side: the matvec kernel, not a tile


def _vec_ok(t: TensorArg, k_axis: int) -> bool:
    """4-element loads along `k_axis` of a [B0, B1, R, K]-shaped descriptor: f32/f16, unit
    stride along k, K a multiple of 4 and every other start 4-aligned (so loads never straddle)."""
    if t.binding.dtype not in ("f32", "f16") or t.strides[k_axis] != 1 or t.shape[k_axis] % 4:
        return False
    return t.elem_offset % 4 == 0 and all(s % 4 == 0 for i, s in enumerate(t.strides) if i != k_axis)


def _rows_view(t: TensorArg, rows_axis: int, k_axis: int) -> TensorArg:
    """The [B0, B1, rows, K] view of a [B0, B1, *, *] descriptor."""
    order = (0, 1, rows_axis, k_axis)
    return TensorArg(t.binding, tuple(t.shape[i] for i in order), tuple(t.strides[i] for i in order), t.elem_offset)


def _stacks_rows(ta: TensorArg, tb: TensorArg) -> bool:
    """b is shared by every batch (stride 0) and a's batches are rows stacked at a's row stride."""
    (b0, b1, m, _), (s0, s1, rs, _) = ta.shape, ta.strides
    if b0 * b1 == 1 or any(s for d, s in zip(tb.shape[:2], tb.strides[:2]) if d > 1):
        return False
    return (b1 == 1 or s1 == m * rs) and (b0 == 1 or s0 == b1 * m * rs)


@dataclass(frozen=True)
class Epilogue:
    """The fused `linear` node's epilogue (common.glsl EPILOGUE): its code and the bias and
    residual descriptors laid out on the dispatch's output coordinates."""

    code: int = 0
    bias: TensorArg | None = None
    residual: TensorArg | None = None

    def swapped(self) -> "Epilogue":
        """The same epilogue for an output written transposed (matvec with swapped operands)."""
        return Epilogue(self.code, *(None if t is None else _swap_last(t) for t in (self.bias, self.residual)))

    def stacked(self, rows: int) -> "Epilogue | None":
        """On [1, 1, B0*B1*M, N] output coordinates, or None when the residual's batches are
        not rows stacked at its row stride."""
        def flat(t: TensorArg | None, is_bias: bool) -> TensorArg | None:
            if t is None:
                return None
            (b0, b1, m, n), (s0, s1, sm, sn) = t.shape, t.strides
            if not is_bias and not ((b1 == 1 or s1 == m * sm) and (b0 == 1 or s0 == b1 * m * sm)):
                raise ValueError
            return TensorArg(t.binding, (1, 1, rows, n), (0, 0, 0 if is_bias else sm, sn), t.elem_offset)
        try:
            return Epilogue(self.code, flat(self.bias, True), flat(self.residual, False))
        except ValueError:
            return None

    def args(self, placeholder: TensorArg) -> list[TensorArg]:
        return [self.bias or placeholder, self.residual or placeholder]


NO_EPILOGUE = Epilogue()
EPI_ACT = {"none": 0, "gelu": 1, "relu": 2, "sigmoid": 3}


def _swap_last(t: TensorArg) -> TensorArg:
    return TensorArg(t.binding, t.shape[:2] + (t.shape[3], t.shape[2]), t.strides[:2] + (t.strides[3], t.strides[2]),
                     t.elem_offset)


def _matvec(name: str, x: TensorArg, y: TensorArg, out: TensorArg, ids: TensorArg | None, program: SplitProgram,
            device: Any, op: str, epi: Epilogue = NO_EPILOGUE) -> Dispatch:
    """out[b, i, j] = sum_k x[b, i, k] * y[b, j, k] (or y = w[ids[i]] with ids), then the epilogue."""
    rows = variants.pick(op, program.tuning, device, family="matvec")
    mode = (1 if _vec_ok(x, 3) else 0) | (2 if _vec_ok(y, 3) else 0) | (4 if ids is not None else 0)
    I = x.shape[1] * x.shape[2] if ids is not None else x.shape[2]
    J = out.shape[3]
    batch = 1 if ids is not None else out.shape[0] * out.shape[1]
    groups = (-(-J // rows.nr), I, batch)
    _check_grid(groups, device)
    dts = (x.binding.dtype, y.binding.dtype, (ids or x).binding.dtype, out.binding.dtype)
    bias, res = epi.args(x)
    return Dispatch(name, "matvec", _spec(mode, *dts) + rows.spec() + (epi.code,), [x, y, ids or bias, out, res], [],
                    groups, writes=[3])


def _check_grid(groups: tuple[int, int, int], device: Any) -> None:
    if any(g > m for g, m in zip(groups, device.info.max_workgroup_count)):
        raise Unsupported(f"grid {groups} exceeds the device's {device.info.max_workgroup_count}")


def _tiled(name: str, ta: TensorArg, tb: TensorArg, to: TensorArg, program: SplitProgram, device: Any, op: str, *,
           conv: list[int] | None = None, ids: TensorArg | None = None, epi: Epilogue = NO_EPILOGUE) -> Dispatch:
    """matmul.comp with the tile the tuning (or the device default) names; matmul_generic.comp
    when no tile fits the device."""
    M = ta.shape[2]
    if conv is not None:
        N, batch = to.shape[1] * to.shape[3], 1
        mode = (1 if _vec_ok(ta, 3) else 0) | 4
    elif ids is not None:  # columns: every (token, slot) pair could go to one expert; batches: experts
        N, batch = tb.shape[1] * tb.shape[2], ta.shape[1]
        mode = (1 if _vec_ok(ta, 3) else 0) | (2 if _vec_ok(tb, 3) else 0) | 8
    else:
        N, batch = to.shape[3], to.shape[0] * to.shape[1]
        mode = (1 if _vec_ok(ta, 3) else 0) | (2 if _vec_ok(tb, 2) else 0)
    if ids is not None:
        tile = variants.pick_tile(device, (M, N))
    else:
        tile = variants.pick(op, program.tuning, device, shape=(M, N))
        if isinstance(tile, variants.Lanes):
            return _lanes(name, ta, tb, to, device, tile, (M, N, batch), mode, conv, epi)
    dts = (ta.binding.dtype, tb.binding.dtype, to.binding.dtype) + ((ids.binding.dtype,) if ids is not None else ())
    if not variants.fits(tile, device.info):
        if conv is not None or ids is not None:
            raise Unsupported("no matmul tile fits this device")
        groups = (-(-N // 16), -(-M // 16), batch)
        _check_grid(groups, device)
        return Dispatch(name, "matmul_generic", _spec(0, *dts) + (epi.code,), [ta, tb, to, *epi.args(ta)], [], groups,
                        writes=[2])
    bias, res = epi.args(ta)
    ti = ids if ids is not None else bias  # binding 4: ids with IDS, the bias with an epilogue
    groups = (-(-N // tile.bn), -(-M // tile.bm), batch)
    _check_grid(groups, device)
    return Dispatch(name, "matmul", _spec(mode, *dts) + tile.spec() + (epi.code,), [ta, tb, to, ti, res],
                    list(conv or []), groups, writes=[2])


def _conv_vec_ok(tb: TensorArg, conv: list[int]) -> bool:
    """conv1d input x [1, B, Cin, Lin] read four taps at a time (matmul_lanes.comp CONV_VEC)."""
    ks, stride, pad, dil = conv
    return (tb.binding.dtype == "f32" and dil == 1 and ks % 4 == 0 and stride % 4 == 0 and pad % 4 == 0
            and tb.strides[3] == 1 and tb.strides[1] % 4 == 0 and tb.strides[2] % 4 == 0 and tb.elem_offset % 4 == 0)


def _lanes(name: str, ta: TensorArg, tb: TensorArg, to: TensorArg, device: Any, lanes: "variants.Lanes",
           dims: tuple[int, int, int], mode: int, conv: list[int] | None, epi: Epilogue) -> Dispatch:
    """matmul_lanes.comp: a TM x TN block per invocation straight from the buffers (CPU drivers).
    `dims` (M, N, batch) and `mode` (A_VEC, B_VEC, CONV) as `_tiled` derived them for matmul.comp;
    the lane kernel's own layout bits are added here: CONV_VEC, B_NVEC where b is not
    contiguous along k but is along n, and K_QUADS when K % 4 == 0 (no tail loop compiled)."""
    M, N, batch = dims
    if conv is not None:
        mode |= 8 if _conv_vec_ok(tb, conv) else 0
    elif not mode & 2 and _vec_ok(tb, 3):
        mode |= 16
    if ta.shape[-1] % 4 == 0:
        mode |= 32
    dts = (ta.binding.dtype, tb.binding.dtype, to.binding.dtype)
    groups = (-(-N // (lanes.wg * lanes.tn)), -(-M // lanes.tm), batch)
    _check_grid(groups, device)
    bias, res = epi.args(ta)
    return Dispatch(name, "matmul_lanes", _spec(mode, *dts) + lanes.spec() + (epi.code,),
                    [ta, tb, to, bias, res], list(conv or []), groups, writes=[2])


def _batched(t: Binding, batch: tuple[int, int], rows: int, cols: int, row_stride: int, col_stride: int) -> TensorArg:
    """A [..., rows, cols] matmul operand on the output's two batch axes (stride 0 where it broadcasts)."""
    tb = (1,) * (2 - (len(t.shape) - 2)) + tuple(t.shape[:-2])
    ts = (0,) * (2 - (len(t.strides) - 2)) + tuple(t.strides[:-2])
    strides = tuple(0 if d == 1 and ob != 1 else s for d, s, ob in zip(tb, ts, batch))
    return arg(t, batch + (rows, cols), strides + (row_stride, col_stride))


ATTENTION_MAX_KEYS = 512  # attention.comp keeps QR rows of scores in shared memory (MAXN)
ATTENTION_ROWS = 4  # QR: query rows per workgroup, so each k and v element is loaded once per 4 rows
# On CPU drivers (kernel profile "cpu"), fused attention only up to this many keys: on lavapipe
# (12 heads, head size 32, best of 20) it took 0.5 / 1.3 ms against the unfused chain's 1.1 /
# 2.3 ms at 12 / 24 keys, about even at 40, and 8.1 against 6.5-7.0 ms at 64 (the tiled
# matmuls load k and v far fewer times than a few query rows per workgroup do).
ATTENTION_CPU_MAX_KEYS = 48


@lowering("attention")
def _attention(node, program, device):
    """Fused attention for small heads: one workgroup per query row (attention.comp)."""
    q, k, v = (_b(program, s) for s in node.srcs[:3])
    out = _b(program, node)
    oshape = tuple(out.shape)
    batch = (1,) * (4 - len(oshape)) + oshape[:-2]
    M, N = q.shape[-2], k.shape[-2]
    tq = _batched(q, batch, M, q.shape[-1], q.strides[-2], q.strides[-1])
    tk = _batched(k, batch, N, k.shape[-1], k.strides[-2], k.strides[-1])
    tv = _batched(v, batch, N, v.shape[-1], v.strides[-2], v.strides[-1])
    if node.params["has_mask"]:
        m = _b(program, node.srcs[3])
        tm, mdt = broadcast_to(m, batch + (M, N)), m.dtype
    else:
        tm, mdt = tq, q.dtype
    params = [f32_bits(node.params["scale"]), int(node.params["has_mask"])]
    groups = _numel(oshape[:-2]) * -(-M // ATTENTION_ROWS)
    return [Dispatch(node.name, "attention", _spec(0, q.dtype, k.dtype, v.dtype, mdt) + _rows(node, program, device)
                     + (ATTENTION_ROWS,), [tq, tk, tv, tm, arg(out)], params, grid(groups, device), writes=[4])]


@lowering("matmul")
def _matmul(node, program, device):
    a, b = (_b(program, s) for s in node.srcs[:2])
    return _matmul_dispatches(node, a, b, _b(program, node), program, device)


@lowering("linear")
def _linear(node, program, device):
    """The fused matmul (flare.core.ops.fused): the epilogue runs in the matmul's store, whichever
    kernel (tile, matvec, generic) the shapes choose."""
    p = node.params
    bias = _b(program, node.srcs[2]) if p["has_bias"] else None
    res = _b(program, node.srcs[-1]) if p["has_residual"] else None
    code = (1 if bias is not None else 0) | (2 if res is not None else 0) | (EPI_ACT[p["act"]] << 2)
    a, b = (_b(program, s) for s in node.srcs[:2])
    return _matmul_dispatches(node, a, b, _b(program, node), program, device, (code, bias, res))


def _matmul_dispatches(node, a: Binding, b: Binding, out: Binding, program, device,
                       fused: tuple[int, Binding | None, Binding | None] | None = None) -> list[Dispatch]:
    oshape = tuple(out.shape)
    batch = (1,) * (4 - len(oshape)) + oshape[:-2]
    M, N = oshape[-2], oshape[-1]
    K = a.shape[-1]
    ta = _batched(a, batch, M, K, a.strides[-2], a.strides[-1])
    if is_quant(b.dtype):  # [..., N, nb] blocks along k (the core allows only transpose_b)
        tb = _batched(b, batch, N, b.shape[-1], b.strides[-2], b.strides[-1])
    elif node.params.get("transpose_b", False):  # b is [..., N, K]
        tb = _batched(b, batch, K, N, b.strides[-1], b.strides[-2])
    else:
        tb = _batched(b, batch, K, N, b.strides[-2], b.strides[-1])
    ostrides = contiguous_strides(batch + (M, N))
    to = arg(out, batch + (M, N), ostrides)
    epi = _epilogue(fused, batch, M, N)
    stacked_rows = batch[0] * batch[1] * M
    stacked_epi = epi.stacked(stacked_rows)
    if stacked_epi is not None and _stacks_rows(ta, tb) and -(-stacked_rows // 16) <= device.info.max_workgroup_count[1]:
        # a linear layer over a batch: one [B*M, K] x [K, N] product fills tiles better
        rows = stacked_rows
        ta = TensorArg(ta.binding, (1, 1, rows, K), (0, 0) + ta.strides[2:], ta.elem_offset)
        tb = TensorArg(tb.binding, (1, 1) + tb.shape[2:], (0, 0) + tb.strides[2:], tb.elem_offset)
        to = TensorArg(to.binding, (1, 1, rows, N), (0, 0, N, 1), to.elem_offset)
        batch, M = (1, 1), rows
        ostrides = (0, 0, N, 1)
        epi = stacked_epi
    if is_quant(b.dtype):  # b is [..., N, nb] blocks (transpose_b): the dequantizing kernels
        if M <= MATVEC_MAX_ROWS:
            return [_matvec_q(node.name, ta, tb, to, None, program, device, "matmul", epi)]
        return [_tiled_q(node.name, ta, tb, to, program, device, "matmul", epi)]
    if M <= MATVEC_MAX_ROWS and M <= N:   # few rows of a: rows of b^T as y
        return [_matvec(node.name, ta, _rows_view(tb, 3, 2), to, None, program, device, "matmul", epi)]
    if N <= MATVEC_MAX_ROWS:              # few columns of b: swap, out^T[n, m] = b^T[n, :] . a[m, :]
        to_t = arg(out, batch + (N, M), ostrides[:2] + (ostrides[3], ostrides[2]))
        return [_matvec(node.name, _rows_view(tb, 3, 2), ta, to_t, None, program, device, "matmul", epi.swapped())]
    return [_tiled(node.name, ta, tb, to, program, device, "matmul", epi=epi)]


def _epilogue(fused: tuple[int, Binding | None, Binding | None] | None, batch: tuple[int, ...], M: int,
              N: int) -> Epilogue:
    """linear's epilogue on the [B0, B1, M, N] output coordinates (NO_EPILOGUE for a plain matmul)."""
    if fused is None:
        return NO_EPILOGUE
    code, bias, res = fused
    return Epilogue(code, None if bias is None else arg(bias, batch + (M, N), (0, 0, 0, bias.strides[0])),
                    None if res is None else broadcast_to(res, batch + (M, N)))


# -- block-quantized weights (quant.glsl) -----------------------------------------------------

def _qspec(mode: int, dtypes: tuple[str, str, str], consts: tuple[int, ...], qtype: str,
           extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Specialization constants of a quantized-weight shader: 0 MODE, 1 the activations' dtype,
    2 and 3 the indices' (dequant.comp reads 2, matvec_q.comp 3), 4 the output's, 5..8 the
    shader's own (`consts`), 9 QT (quant.glsl: the block type of the weights), 10.. `extra`."""
    x_dt, i_dt, o_dt = dtypes
    head = (mode, DT[x_dt], DT[i_dt] if i_dt else 0, DT[i_dt] if i_dt else 0, DT[o_dt])
    return head + tuple(consts) + (0,) * (4 - len(consts)) + (QT[qtype],) + tuple(extra)


def _matvec_q(name: str, x: TensorArg, w: TensorArg, out: TensorArg, ids: TensorArg | None, program: SplitProgram,
              device: Any, op: str, epi: Epilogue = NO_EPILOGUE) -> Dispatch:
    """matvec_q.comp: out[b, i, j] = x[b, i, :] . dequant(w[b, j, :]) (w = experts[ids[i]] with ids)."""
    rows = variants.pick(op, program.tuning, device, family="matvec")
    qt = w.binding.dtype
    mode = (1 if _vec_ok(x, 3) else 0) | (4 if ids is not None else 0)
    I = x.shape[1] * x.shape[2] if ids is not None else x.shape[2]
    J = out.shape[3]
    batch = 1 if ids is not None else out.shape[0] * out.shape[1]
    groups = (-(-J // rows.nr), I, batch)
    _check_grid(groups, device)
    unit = variants.quant_unit(device, QSUB.get(qt, 32))
    dts = (x.binding.dtype, ids.binding.dtype if ids is not None else "", out.binding.dtype)
    bias, res = epi.args(x)
    return Dispatch(name, "matvec_q", _qspec(mode, dts, (rows.wg, rows.nr, epi.code, unit), qt),
                    [x, w, ids or bias, out, res], [], groups, writes=[3])


def _tiled_q(name: str, ta: TensorArg, tw: TensorArg, to: TensorArg, program: SplitProgram, device: Any, op: str,
             epi: Epilogue) -> Dispatch:
    """matmul_q_lanes.comp (a lane block) or matmul_q.comp (a shared-memory tile, the weights
    dequantized into it), as the tuning or the device profile picks."""
    M, N, batch = ta.shape[2], to.shape[3], to.shape[0] * to.shape[1]
    qt = tw.binding.dtype
    mode = 1 if _vec_ok(ta, 3) else 0
    v = variants.pick_quant(op, program.tuning, device, (M, N), QSUB.get(qt, 32))
    dts = (ta.binding.dtype, "", to.binding.dtype)
    bias, res = epi.args(ta)
    if isinstance(v, variants.Lanes):
        groups = (-(-N // (v.wg * v.tn)), -(-M // v.tm), batch)
        shader, spec = "matmul_q_lanes", _qspec(mode, dts, (v.wg, v.tm, v.tn, epi.code), qt)
    else:
        groups = (-(-N // v.bn), -(-M // v.bm), batch)
        shader, spec = "matmul_q", _qspec(mode, dts, (v.wg, v.bm, v.bn, v.bk), qt, (v.tm, v.tn, epi.code))
    _check_grid(groups, device)
    return Dispatch(name, shader, spec, [ta, tw, to, bias, res], [], groups, writes=[2])


DEQUANT_WG = 256  # dequant.comp's local size; each invocation writes four weights


def _dequant_dispatch(name: str, tw: TensorArg, ti: TensorArg | None, to: TensorArg, device: Any) -> Dispatch:
    """dequant.comp: `tw`'s blocks (rows `ti` picks, for get_rows) as f32 weights into `to`."""
    if to.binding.dtype != "f32":  # the op rules make these outputs f32; the shader writes f32 words
        raise Unsupported(f"dequantized output of dtype {to.binding.dtype}")
    n4 = -(-_numel(to.shape) // 4)
    dts = ("f32", ti.binding.dtype if ti is not None else "", to.binding.dtype)
    return Dispatch(name, "dequant", _qspec(0 if ti is None else 1, dts, (), tw.binding.dtype), [tw, ti or tw, to], [],
                    grid(-(-n4 // DEQUANT_WG), device), writes=[2])


@lowering("dequantize")
def _dequantize(node, program, device):
    return [_dequant_dispatch(node.name, arg4(_b(program, node.srcs[0])), None, arg4(_b(program, node)), device)]


@lowering("layer_norm", "rms_norm", "softmax", "norm_affine")
def _rownorm(node, program, device):
    x = _b(program, node.srcs[0])
    out = _b(program, node)
    tx = arg(x)
    tbeta = tx  # binding 4: beta of norm_affine, else not read
    if node.op == "norm_affine":  # the norm, times gamma (in the mask's slot), plus beta: one pass
        p = node.params
        mode = (0 if p["norm"] == "layer" else 1) | 4 | (8 if p["has_beta"] else 0)
        g = _b(program, node.srcs[1])
        tm, mdt = broadcast_to(g, x.shape), g.dtype
        if p["has_beta"]:
            tbeta = broadcast_to(_b(program, node.srcs[2]), x.shape)
        params = [f32_bits(p["eps"])]
    elif node.op == "softmax":
        mode = 2
        if len(node.srcs) > 1:
            m = _b(program, node.srcs[1])
            tm, mdt, has = broadcast_to(m, x.shape), m.dtype, 1
        else:
            tm, mdt, has = tx, x.dtype, 0
        params = [f32_bits(node.params.get("scale", 1.0)), has]
    else:
        mode = 0 if node.op == "layer_norm" else 1
        tm, mdt = tx, x.dtype
        params = [f32_bits(node.params.get("eps", 1e-5 if node.op == "layer_norm" else 1e-6))]
    rows = _numel(x.shape[:-1])
    return [Dispatch(node.name, "rownorm", _spec(mode, x.dtype, mdt, out.dtype) + _rows(node, program, device),
                     [tx, tm, arg(out), tbeta], params, grid(rows, device), writes=[2])]


def _rows(node: Tensor, program: SplitProgram, device: Any) -> tuple[int, ...]:
    """The workgroup size of a one-workgroup-per-row kernel (tuning or device default)."""
    return (variants.pick(node.op, program.tuning, device).wg,)


@lowering(*REDUCE)
def _reduce(node, program, device):
    x = _b(program, node.srcs[0])
    out = _b(program, node)
    rank = len(x.shape)
    axis = int(node.params.get("axis", -1)) % rank
    order = [i for i in range(rank) if i != axis] + [axis]
    shape = tuple(x.shape[i] for i in order)
    strides = tuple(x.strides[i] for i in order)
    rows = _numel(shape[:-1])
    return [Dispatch(node.name, "reduce", _spec(REDUCE[node.op], x.dtype, out.dtype) + _rows(node, program, device),
                     [arg(x, shape, strides), arg(out)], [], grid(rows, device), writes=[1])]


@lowering("top_k")
def _top_k(node, program, device):
    x = _b(program, node.srcs[0])
    out = _b(program, node)
    rows = _numel(x.shape[:-1])
    return [Dispatch(node.name, "top_k", _spec(0, x.dtype, out.dtype) + _rows(node, program, device), [arg(x), arg(out)],
                     [int(node.params["k"])], grid(rows, device), writes=[1])]


@lowering("get_rows")
def _get_rows(node, program, device):
    table, idx = (_b(program, s) for s in node.srcs)
    out = _b(program, node)
    if is_quant(table.dtype):
        return [_dequant_dispatch(node.name, arg4(table), arg(idx), arg4(out), device)]
    return [Dispatch(node.name, "get_rows", _spec(0, table.dtype, idx.dtype, out.dtype), [arg(table), arg(idx), arg(out)],
                     [], elementwise_grid(_numel(out.shape), device), writes=[2])]


@lowering("set_rows")
def _set_rows(node, program, device):
    dst, idx, src = (_b(program, s) for s in node.srcs)
    out = _b(program, node)
    pre = [] if _same_place(dst, out) else [_copy_dispatch(node.name + ":dst", dst, out, device)]
    to = arg(out, dst.shape, contiguous_strides(dst.shape))
    return pre + [Dispatch(node.name, "set_rows", _spec(0, idx.dtype, src.dtype, out.dtype), [arg(idx), arg(src), to], [],
                           elementwise_grid(_numel(src.shape), device), writes=[2])]


@lowering("gather")
def _gather(node, program, device):
    x, idx = (_b(program, s) for s in node.srcs)
    out = _b(program, node)
    return [Dispatch(node.name, "gather", _spec(0, x.dtype, idx.dtype, out.dtype), [arg(x), arg(idx), arg(out)], [],
                     elementwise_grid(_numel(out.shape), device), writes=[2])]


@lowering("rope")
def _rope(node, program, device):
    x, pos = (_b(program, s) for s in node.srcs)
    out = _b(program, node)
    n, h, d = x.shape
    params = [f32_bits(node.params.get("base", 10000.0)), 1 if node.params.get("neox", True) else 0]
    return [Dispatch(node.name, "rope", _spec(0, x.dtype, pos.dtype, out.dtype), [arg(x), arg(pos), arg(out)], params,
                     elementwise_grid(n * h * (d // 2), device), writes=[2])]


@lowering("conv1d")
def _conv1d(node, program, device):
    x, w = (_b(program, s) for s in node.srcs)
    out = _b(program, node)
    stride, padding, dilation = (int(node.params.get(k, d)) for k, d in (("stride", 1), ("padding", 0), ("dilation", 1)))
    cout, cin, ks = w.shape
    if w.strides[1] == ks * w.strides[2]:  # (cin, k) folds into one K axis: an implicit-im2col matmul
        ta = arg(w, (1, 1, cout, cin * ks), (0, 0, w.strides[0], w.strides[2]))
        try:
            return [_tiled(node.name, ta, arg4(x), arg4(out), program, device, "conv1d",
                           conv=[ks, stride, padding, dilation])]
        except Unsupported:
            pass
    return [Dispatch(node.name, "conv1d", _spec(0, x.dtype, w.dtype, out.dtype), [arg(x), arg(w), arg(out)],
                     [stride, padding, dilation], elementwise_grid(_numel(out.shape), device), writes=[2])]


# lstm.comp: the CPU-driver variant keeps each invocation's four W_hh rows private (up to this
# many hidden units); every variant keeps h (twice) and c in shared memory: 12 KiB at
# LSTM_MAX_HIDDEN units, inside the 16 KiB every Vulkan device must offer.
LSTM_PRIVATE_MAX_HIDDEN = 256
LSTM_MAX_HIDDEN = 1024
LSTM_GPU_WG = 256


def _lstm_shape(node: Tensor, device: Any) -> tuple[int, int, bool]:
    """(workgroup size, HCAP, private rows) of lstm.comp for this node on this device."""
    hidden = node.srcs[1].shape[1]
    hcap = max(32, 1 << (hidden - 1).bit_length())
    if device.kernel_profile == "cpu" and hidden <= LSTM_PRIVATE_MAX_HIDDEN and hcap <= device.info.max_workgroup_invocations:
        return hcap, hcap, True
    return min(LSTM_GPU_WG, device.info.max_workgroup_invocations), hcap, False


@lowering("lstm")
def _lstm(node, program, device):
    """The whole recurrence in one dispatch, one workgroup per batch row (lstm.comp)."""
    x, w, h0, c0 = (_b(program, s) for s in node.srcs)
    out = _b(program, node)
    wg, hcap, private = _lstm_shape(node, device)
    groups = (x.shape[1], 1, 1)
    _check_grid(groups, device)
    return [Dispatch(node.name, "lstm", _spec(int(private), x.dtype, w.dtype, h0.dtype, c0.dtype) + (wg, hcap),
                     [arg4(x), arg4(w), arg4(h0), arg4(c0), arg4(out)], [], groups, writes=[4])]


@lowering("mul_mat_id")
def _mul_mat_id(node, program, device):
    w, x, ids = (_b(program, s) for s in node.srcs)
    out = _b(program, node)
    T, k, N = out.shape
    K = x.shape[-1]
    if len(x.shape) == 2:
        tx = arg(x, (1, T, k, K), (0, x.strides[0], 0, x.strides[1]))
    else:
        tx = arg(x, (1, T, k, K), (0,) + tuple(x.strides))
    if is_quant(w.dtype):  # quantized experts: decode-sized, one (token, slot) pair per workgroup row
        return [_matvec_q(node.name, tx, arg4(w), arg4(out), arg4(ids), program, device, "mul_mat_id")]
    if T * k >= MMID_TILED_MIN_PAIRS:  # many routed rows: experts' weights staged once per tile of rows
        try:
            return [_tiled(node.name, arg4(w), tx, arg4(out), program, device, "mul_mat_id", ids=arg4(ids))]
        except Unsupported:
            pass
    return [_matvec(node.name, tx, arg4(w), arg4(out), arg4(ids), program, device, "mul_mat_id")]


# -- supports -------------------------------------------------------------------------------

# op -> allowed dtypes per source position (the last entry repeats for extra sources)
SRC_DTYPES: dict[str, tuple[tuple[str, ...], ...]] = {
    **{op: (FLOAT_IN,) for op in (*BINARY, "scale", *UNARY, "layer_norm", "rms_norm", "softmax",
                                  *REDUCE, "top_k")},
    "matmul": (FLOAT_IN, FLOAT_IN + QUANT),  # quantized b: transpose_b only (the core refuses the rest)
    **{op: (ANY,) for op in (*VIEW_OPS, "contiguous", "cast", "concat", "pad", "copy_into")},
    "get_rows": (("f32", "f16", *QUANT), INDEX),
    "dequantize": (QUANT,),
    "gather": (FLOAT_IN, INDEX),
    "rope": (FLOAT_IN, INDEX),
    "conv1d": (FLOAT_IN,),
    "mul_mat_id": (("f32", "f16", *QUANT), ("f32", "f16"), INDEX),
    "set_rows": (ANY, INDEX, ANY),
    "linear": (FLOAT_IN, FLOAT_IN + QUANT, ("f32",)),  # bias and residual: f32 (flare.core.ops.fused)
    "norm_affine": (FLOAT_IN, ("f32",)),
    "leaky_relu": (("f32",),),
    "attention": (FLOAT_IN, FLOAT_IN, FLOAT_IN, ("f32", "f16")),
    "lstm": (("f32",),),
}


def supports(node: Tensor, device: Any) -> bool:
    """True when a lowering exists and the node's dtypes and sizes fit the shaders and device limits."""
    if node.op not in LOWER or node.op not in SRC_DTYPES:
        return False
    allowed = SRC_DTYPES[node.op]
    for i, src in enumerate(node.srcs):
        if src.dtype not in allowed[min(i, len(allowed) - 1)]:
            return False
    if node.dtype not in ANY or len(node.shape) > 4:
        return False
    for t in (node, *node.srcs):
        if t.size >= MAX_ELEMENTS or (t.dtype == "i64" and t.size >= MAX_ELEMENTS // 2):
            return False
    n_buffers = {"mul_mat_id": 5, "matmul": 5, "linear": 5, "conv1d": 5, "reduce": 2, "top_k": 2,
                 "layer_norm": 4, "rms_norm": 4, "softmax": 4, "norm_affine": 4, "attention": 5,
                 "lstm": 5}.get(node.op, 3)
    if n_buffers + 1 > device.info.max_storage_buffers_per_stage:
        return False
    if node.op == "attention":
        keys = node.srcs[1].shape[-2]
        limit = ATTENTION_CPU_MAX_KEYS if device.kernel_profile == "cpu" else ATTENTION_MAX_KEYS
        if node.dtype != "f32" or keys > limit:
            return False
    if node.op == "rope" and node.srcs[0].shape[-1] % 2:
        return False
    if node.op == "lstm":
        hcap = _lstm_shape(node, device)[1]
        shared = 4 * 3 * hcap  # h twice (double-buffered) and c
        if node.srcs[1].shape[1] > LSTM_MAX_HIDDEN or shared > device.info.max_shared_memory:
            return False
        if node.shape[1] > device.info.max_workgroup_count[0]:
            return False
    if node.op == "pad" and node.params.get("mode", "constant") not in ("constant", "reflect"):
        return False
    if node.op in ("matmul", "linear", "mul_mat_id"):
        out = node.shape
        batch = _numel(out[:-2]) if node.op != "mul_mat_id" else 1
        rows = out[-2] if node.op != "mul_mat_id" else out[0] * out[1]
        mx, my, mz = device.info.max_workgroup_count
        if -(-out[-1] // 16) > mx or rows > my or batch > mz:  # the smallest tile / one matvec row per group
            return False
    if not device.info.subgroup_ops & SUBGROUP_ARITHMETIC:  # matvec and row kernels reduce with subgroup ops
        if node.op in ROW_OPS or node.op in ("mul_mat_id", "norm_affine", "attention", "lstm"):
            return False
        if node.op in ("matmul", "linear") and min(node.shape[-2], node.shape[-1]) <= MATVEC_MAX_ROWS:
            return False
    return True


def lower(node: Tensor, program: SplitProgram, device: Any) -> list[Dispatch]:
    """The dispatches for one node (none for views); zero-size outputs dispatch nothing."""
    try:
        fn = LOWER[node.op]
    except KeyError:
        raise Unsupported(f"op {node.op!r} has no Vulkan kernel") from None
    return [d for d in fn(node, program, device) if all(g > 0 for g in d.groups) and _numel(d.args[d.writes[0]].shape) > 0]
