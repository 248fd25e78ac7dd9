"""From graph nodes to kernel launches: which kernel, how many threads, what arguments.

Pure Python over `Binding`s: no driver, no GPU. The same launch plans run on a
CUDA device (captured into a CUDA graph) and in the host emulator (tests), so
everything here is checked against the NumPy references without a GPU.

Conventions shared with kernels/*.cu: tensors are padded to rank 4 on the
left; broadcasting and `transpose_b` are expressed as strides, never copies;
outputs are contiguous. Elementwise kernels do one unit of work per thread for
`n` threads in 1-D blocks of `BLOCK`; row kernels (norms, softmax, reductions,
top_k) run one block per row (`row_grid`, `row_block`), lstm one block per
batch row; matmuls pick a tiled, matrix-vector or generic kernel by layout,
size and the split's tuning (`matmul_plan`). Block-quantized weights (whose
descriptors count blocks) go to matmul_q.cu and dequant.cu (`_matmul_q_launches`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from flare.core.dtypes import is_quant
from flare.core.backend import Binding
from flare.core.graph import Tensor

from .args import KArgs, broadcast_strides, fill

BLOCK = 256

# op codes, in step with the enums of elementwise.cu and reduce.cu
UNARY_CODES = {"relu": 0, "gelu": 1, "silu": 2, "sigmoid": 3, "tanh": 4, "exp": 5, "sqrt": 6, "neg": 7, "sqr": 8,
               "scale": 9, "leaky_relu": 10}
BINARY_CODES = {"add": 0, "sub": 1, "mul": 2, "div": 3}
REDUCE_CODES = {"sum": 0, "mean": 1, "max": 2, "argmax": 3}
VIEW_OPS = frozenset({"slice", "reshape", "permute", "transpose"})

BindingOf = Callable[[Tensor], Binding]
Tuning = Mapping[str, str] | None  # op -> kernel variant (SplitProgram.tuning)


MAX_GRID = 65535          # blocks along grid y and z (x allows more; rows stay within it too)
ROW_BLOCK_MAX = 256       # threads of a row kernel's block
MM_TILES = {"t32": "s", "t64": "m", "t128": "l"}    # tuning variant -> kernel tile (matmul.cu)
MM_TILE_SIZE = {"s": 32, "m": 64, "l": 128}
# Kernel variants (Device.kernel_variants; SplitProgram.tuning[op] picks one, the first is the
# default): "auto" picks the tile (or the matrix-vector kernel) by shape; "naive" is the generic
# one-thread-per-output kernel.
MM_VARIANTS = ("auto", *MM_TILES, "naive")
MMID_VARIANTS = ("mv", "naive")
KERNEL_VARIANTS = {"matmul": MM_VARIANTS, "linear": MM_VARIANTS, "conv1d": MM_VARIANTS, "mul_mat_id": MMID_VARIANTS}
MV_MAX_ROWS = 4           # matmuls with at most this many rows use the matrix-vector kernel (MV_MAX_M)
MV_OUTPUTS_PER_BLOCK = 16  # 8 warps x MV_ROWS (matmul.cu)
TOPK_P = 2048


@dataclass
class Launch:
    """One kernel launch of `kernel` (in kernel file `module`) over `args`: `n` threads in
    1-D blocks of BLOCK, unless `grid_dim`/`block_dim` say otherwise (`n` is then the
    kernel's own work count, e.g. rows)."""

    module: str
    kernel: str
    n: int
    args: KArgs
    node: str = ""
    grid_dim: tuple[int, int, int] | None = None
    block_dim: tuple[int, int, int] | None = None

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.grid_dim or (max(1, -(-self.n // BLOCK)), 1, 1)

    @property
    def block(self) -> tuple[int, int, int]:
        return self.block_dim or (BLOCK, 1, 1)


def row_grid(rows: int) -> tuple[int, int, int]:
    """One block per row: x up to MAX_GRID, the rest continues in y (kernels read
    row = blockIdx.y * gridDim.x + blockIdx.x and skip rows >= n)."""
    x = max(1, min(rows, MAX_GRID))
    return (x, max(1, -(-rows // x)), 1)


def row_block(length: int) -> tuple[int, int, int]:
    """Threads for one row of `length`: a power of two, 32..ROW_BLOCK_MAX (full warps)."""
    n = 32
    while n < length and n < ROW_BLOCK_MAX:
        n *= 2
    return (n, 1, 1)


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _launch(module: str, kernel: str, n: int, node: Tensor, *tensors, ints=(), floats=(),
            grid=None, block=None) -> list[Launch]:
    """Build one launch; `tensors` are Bindings or (Binding, shape, strides) layouts.

    Returns [] for empty work: a zero-sized tensor needs no kernel."""
    if n <= 0:
        return []
    args = KArgs()
    for slot, t in enumerate(tensors):
        if t is None:  # an unused slot (kernels with fixed slots for optional operands)
            continue
        if isinstance(t, tuple):
            fill(args.t[slot], *t)
        else:
            fill(args.t[slot], t)
    args.n = n
    for k, v in enumerate(ints):
        args.i[k] = int(v)
    for k, v in enumerate(floats):
        args.f[k] = float(v)
    return [Launch(module, kernel, n, args, node.name, grid, block)]


# ---- per-op lowerings ------------------------------------------------------------

def _unary(node: Tensor, b: BindingOf) -> list[Launch]:
    x, out = b(node.srcs[0]), b(node)
    if node.op == "scale":
        floats = (node.params["scale"], node.params.get("bias", 0.0))
    elif node.op == "leaky_relu":  # one pass of the chain alpha*x + (1 - alpha)*relu(x) (flare.core.ops.fused)
        floats = (node.params["alpha"], 1.0 - node.params["alpha"])
    else:
        floats = ()
    return _launch("elementwise", "flare_unary", _size(out.shape), node, x, out,
                   ints=(UNARY_CODES[node.op],), floats=floats)


def _binary(node: Tensor, b: BindingOf) -> list[Launch]:
    x, y, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    lx = (x, out.shape, broadcast_strides(x.shape, x.strides, out.shape))
    ly = (y, out.shape, broadcast_strides(y.shape, y.strides, out.shape))
    return _launch("elementwise", "flare_binary", _size(out.shape), node, lx, ly, out, ints=(BINARY_CODES[node.op],))


def _aligned4(binding, *strides) -> bool:
    """Whether float4 loads are aligned: buffers are 256-byte aligned, so the element
    offset and every step between rows must be multiples of 4 elements."""
    return binding.dtype == "f32" and (binding.offset // 4) % 4 == 0 and all(int(s) % 4 == 0 for s in strides)


def matmul_plan(m: int, n: int, k: int, a_kcontig: bool, b_kstride: int, b_nstride: int, b_dtype: str,
                variant: str | None) -> tuple[str, str]:
    """(kind, kernel) for a matmul: kind is "mv", "tiled" or "naive".

    The tile is the tuning's `variant` (t32/t64/t128) when given, else picked by
    size: the largest tile whose side the output still fills."""
    if variant == "naive":
        return "naive", "flare_matmul"
    if variant is None and m <= MV_MAX_ROWS and b_kstride == 1:
        return "mv", "flare_mv_mm_h" if b_dtype == "f16" else "flare_mv_mm"
    if variant in MM_TILES:
        tile = MM_TILES[variant]
    else:
        side = min(m, n)
        tile = "l" if side >= 512 else "m" if side >= 64 else "s"
    if a_kcontig and b_kstride == 1:
        layout = "nt"
    elif a_kcontig and b_nstride == 1:
        layout = "nn"
    else:
        return "tiled", f"flare_mm_{tile}_st"
    return "tiled", f"flare_mm_{tile}_{layout}" + ("_h" if b_dtype == "f16" else "")


EPILOGUE_ACTS = {"none": 0, "gelu": 1, "relu": 2, "sigmoid": 3}  # common.cuh ACT_*


def _matmul(node: Tensor, b: BindingOf, tuning: Tuning = None) -> list[Launch]:
    return _matmul_launches(node, b(node.srcs[0]), b(node.srcs[1]), b(node), bool(node.params.get("transpose_b")),
                            (tuning or {}).get("matmul"))


def _linear(node: Tensor, b: BindingOf, tuning: Tuning = None) -> list[Launch]:
    """The fused `linear` op: the matmul kernels with their epilogue act(v + bias) + residual."""
    p = node.params
    bias = b(node.srcs[2]) if p.get("has_bias") else None
    residual = b(node.srcs[-1]) if p.get("has_residual") else None
    return _matmul_launches(node, b(node.srcs[0]), b(node.srcs[1]), b(node), bool(p.get("transpose_b")),
                            (tuning or {}).get("linear", (tuning or {}).get("matmul")),
                            (EPILOGUE_ACTS[p.get("act", "none")], bias, residual))


def _matmul_launches(node: Tensor, x: Binding, w: Binding, out: Binding, transpose_b: bool, variant: str | None,
                     epilogue: tuple[int, Binding | None, Binding | None] = (0, None, None)) -> list[Launch]:
    if _size(out.shape) == 0:
        return []  # (a 2-D grid of zero blocks is not a launch)
    batch = tuple(out.shape[:-2])
    m, n = out.shape[-2:]
    k = x.shape[-1]
    if transpose_b:
        w_mat_strides = (w.strides[-1], w.strides[-2])  # [N, K] read as [K, N]
    else:
        w_mat_strides = (w.strides[-2], w.strides[-1])
    pad = (1,) * (2 - len(batch))
    xb = broadcast_strides(x.shape[:-2], x.strides[:-2], batch)
    wb = broadcast_strides(w.shape[:-2], w.strides[:-2], batch)
    zero = (0,) * len(pad)
    lx = (x, pad + batch + (m, k), zero + xb + (x.strides[-2], x.strides[-1]))
    lw = (w, pad + batch + (k, n), zero + wb + w_mat_strides)
    lo = (out, pad + batch + (m, n), zero + tuple(out.strides[:-2]) + tuple(out.strides[-2:]))
    act, bias, residual = epilogue
    lr = None if residual is None else (residual, lo[1], zero + tuple(residual.strides))
    tail = (None, bias, lr)  # slots 3..5: t4 = bias, t5 = residual (flare_epilogue)
    ep_ints = (act, (1 if bias is not None else 0) | (2 if residual is not None else 0))
    nbatch = _size(batch)
    if is_quant(w.dtype):
        lw = (w, pad + batch + (n, w.shape[-1]), zero + wb + (w.strides[-2], w.strides[-1]))
        return _matmul_q_launches(node, lx, lw, lo, tail, ep_ints, variant)
    a_kcontig = x.dtype == "f32" and (x.strides[-1] == 1 or k == 1)
    b_kstride = w_mat_strides[0] if k > 1 else 1
    b_nstride = w_mat_strides[1] if n > 1 else 1
    kind, kernel = matmul_plan(m, n, k, a_kcontig, b_kstride, b_nstride, w.dtype,
                               variant if variant in MM_VARIANTS and variant != "auto" else None)
    if kind == "naive" or w.dtype not in ("f32", "f16") or nbatch > MAX_GRID or -(-m // 32) > MAX_GRID:
        # (batches beyond grid z, or rows beyond grid y, go one thread per output)
        return _launch("matmul", "flare_matmul", _size(out.shape), node, lx, lw, lo, *tail,
                       ints=(0, 0, 0, 0, *ep_ints))
    if kind == "mv":  # one block per batch, all m <= MV_MAX_ROWS rows of it together
        vec = 2 if k % 4 == 0 and _aligned4(w, w_mat_strides[1], *wb) else 0
        gy = min(nbatch, MAX_GRID)
        grid = (-(-n // MV_OUTPUTS_PER_BLOCK), gy, -(-nbatch // gy))
        return _launch("matmul", kernel, nbatch, node, lx, lw, lo, *tail, ints=(vec, 0, 0, 0, *ep_ints), grid=grid,
                       block=(256, 1, 1))
    vec = 0
    if kernel.endswith(("_nt", "_nn")):
        if k % 4 == 0 and _aligned4(x, x.strides[-2], *xb):
            vec |= 1
        if kernel.endswith("_nt") and k % 4 == 0 and _aligned4(w, w_mat_strides[1], *wb):
            vec |= 2
        if kernel.endswith("_nn") and n % 4 == 0 and _aligned4(w, w_mat_strides[0], *wb):
            vec |= 2
    side = MM_TILE_SIZE[kernel.split("_")[2]]
    grid = (-(-n // side), -(-m // side), nbatch)
    return _launch("matmul", kernel, _size(out.shape), node, lx, lw, lo, *tail, ints=(vec, 0, 0, 0, *ep_ints),
                   grid=grid, block=(256, 1, 1))


def _matmul_q_launches(node: Tensor, lx, lw, lo, tail, ep_ints, variant: str | None) -> list[Launch]:
    """matmul/linear with block-quantized weights (matmul_q.cu): `lw` is the weight as it is
    stored, [B0,B1,N,NB] blocks (transpose_b: rows of blocks along k). At most MV_MAX_ROWS
    rows of x take the matrix-vector kernel with 8-bit activations and integer dot products
    (`flare_mvq8_*`, ggml's mmvq), or with the `naive` tuning its float twin (`flare_mvq_*`:
    exact weights, float products); more rows take the tiled kernel (tile by size, or the
    tuning's t32/t64/t128)."""
    x, shape, xstrides = lx
    qt = lw[0].dtype
    m, n, k = shape[-2], lo[1][-1], shape[-1]
    nbatch = _size(shape[:-2])
    if variant not in MM_TILES and m <= MV_MAX_ROWS:
        gy = min(nbatch, MAX_GRID)
        grid = (-(-n // MV_OUTPUTS_PER_BLOCK), gy, -(-nbatch // gy))
        kernel = f"flare_mvq_{qt}" if variant == "naive" else f"flare_mvq8_{qt}"
        return _launch("matmul_q", kernel, nbatch, node, lx, lw, lo, *tail, ints=(0, 0, 0, 0, *ep_ints),
                       grid=grid, block=(256, 1, 1))
    tile = MM_TILES.get(variant or "", "l" if min(m, n) >= 512 else "m" if min(m, n) >= 64 else "s")
    side = MM_TILE_SIZE[tile]
    flags = 0
    if x.dtype == "f32" and xstrides[-1] == 1:
        flags |= 4  # K-contiguous rows
        if k % 4 == 0 and _aligned4(x, xstrides[-2], *xstrides[:-2]):
            flags |= 1  # ... read as float4
    grid = (-(-n // side), -(-m // side), nbatch)
    return _launch("matmul_q", f"flare_mmq_{tile}_{qt}", _size(lo[1]), node, lx, lw, lo, *tail,
                   ints=(flags, 0, 0, 0, *ep_ints), grid=grid, block=(256, 1, 1))


def _quant_fits(node: Tensor) -> bool:
    """Whether a node reading block-quantized weights fits the quantized kernels' grids
    (matmul_q.cu has no one-thread-per-output fallback for batches past grid z or row tiles
    past grid y; mul_mat_id's (token, slot) pairs continue from grid y into z)."""
    if node.op in ("matmul", "linear"):
        if not is_quant(node.srcs[1].dtype) or any(is_quant(s.dtype) for i, s in enumerate(node.srcs) if i != 1):
            return False
        m = node.shape[-2]
        return _size(node.shape[:-2]) <= MAX_GRID and -(-m // MM_TILE_SIZE["s"]) <= MAX_GRID
    if node.op == "mul_mat_id":
        t, k = node.srcs[2].shape
        return is_quant(node.srcs[0].dtype) and t * k <= MAX_GRID * MAX_GRID
    return node.op in ("get_rows", "dequantize") and is_quant(node.srcs[0].dtype)


def _attention(node: Tensor, b: BindingOf) -> list[Launch]:
    """The fused `attention` op: one block per query row (attention.cu)."""
    q, k, v, out = b(node.srcs[0]), b(node.srcs[1]), b(node.srcs[2]), b(node)
    batch = tuple(out.shape[:-2])
    pad = (1,) * (2 - len(batch))
    zero = (0,) * len(pad)
    lq, dk, lk, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]

    def layout(t: Binding, rows: int, cols: int):
        bs = broadcast_strides(t.shape[:-2], t.strides[:-2], batch)
        return (t, pad + batch + (rows, cols), zero + bs + (t.strides[-2], t.strides[-1]))

    if node.params.get("has_mask"):
        mb = b(node.srcs[3])
        scores = batch + (lq, lk)
        mask = (mb, pad + scores, zero + broadcast_strides(mb.shape, mb.strides, scores))
    else:
        mask = None
    rows = _size(batch) * lq
    return _launch("attention", "flare_attention", rows, node, layout(q, lq, dk), layout(k, lk, dk),
                   layout(v, lk, dv), mask, (out, pad + batch + (lq, dv), zero + tuple(out.strides)),
                   ints=(1 if mask is not None else 0,), floats=(node.params.get("scale", 1.0),),
                   grid=row_grid(rows), block=row_block(max(lk, dv)))


ATTENTION_MAX_KEYS, ATTENTION_MAX_DIM = 4096, 256  # attention.cu's shared rows


def _rows(shape) -> int:
    return _size(shape[:-1]) if len(shape) > 1 else 1


def _norm(node: Tensor, b: BindingOf) -> list[Launch]:
    """layer_norm, rms_norm, and the fused norm_affine (times gamma, plus beta, same pass)."""
    x, out = b(node.srcs[0]), b(node)
    if node.op == "norm_affine":
        mode = 0 if node.params.get("norm", "layer") == "layer" else 1
        gamma = b(node.srcs[1])
        beta = b(node.srcs[2]) if node.params.get("has_beta") else None
        affine = 1 | (2 if beta is not None else 0)
    else:
        mode, gamma, beta, affine = (0 if node.op == "layer_norm" else 1), None, None, 0
    rows = _rows(x.shape) if x.shape[-1] else 0
    return _launch("norm", "flare_norm", rows, node, x, out, gamma, beta, ints=(mode, affine),
                   floats=(node.params["eps"],), grid=row_grid(rows), block=row_block(x.shape[-1]))


def _softmax(node: Tensor, b: BindingOf) -> list[Launch]:
    x, out = b(node.srcs[0]), b(node)
    if len(node.srcs) == 2:
        m = b(node.srcs[1])
        mask = (m, x.shape, broadcast_strides(m.shape, m.strides, x.shape))
        has_mask = 1
    else:
        mask, has_mask = x, 0
    rows = _rows(x.shape) if x.shape[-1] else 0
    return _launch("norm", "flare_softmax", rows, node, x, mask, out, ints=(has_mask,),
                   floats=(node.params.get("scale", 1.0),), grid=row_grid(rows), block=row_block(x.shape[-1]))


def _get_rows(node: Tensor, b: BindingOf) -> list[Launch]:
    table, idx, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    if is_quant(table.dtype):  # unpack only the selected rows (dequant.cu)
        return _launch("dequant", "flare_get_rows_q", _size(out.shape), node, table, idx, out)
    return _launch("index", "flare_get_rows", _size(out.shape), node, table, idx, out)


def _dequantize(node: Tensor, b: BindingOf) -> list[Launch]:
    w, out = b(node.srcs[0]), b(node)
    return _launch("dequant", "flare_dequantize", _size(out.shape), node, w, out)


def _set_rows(node: Tensor, b: BindingOf) -> list[Launch]:
    dst, idx, src = (b(s) for s in node.srcs)
    return _launch("index", "flare_set_rows", _size(src.shape), node, dst, idx, src)


def _gather(node: Tensor, b: BindingOf) -> list[Launch]:
    x, idx, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    return _launch("index", "flare_gather", _size(idx.shape), node, x, idx, out)


def _top_k(node: Tensor, b: BindingOf) -> list[Launch]:
    x, out = b(node.srcs[0]), b(node)
    rows, length, k = _rows(x.shape), x.shape[-1], node.params["k"]
    p = 1
    while p < min(length, TOPK_P):
        p *= 2
    if length > p and k > p // 2:  # nothing the models ask for: the one-thread-per-row kernel
        return _launch("index", "flare_top_k_serial", rows, node, x, out, ints=(k,))
    return _launch("index", "flare_top_k", rows, node, x, out, ints=(k, p), grid=row_grid(rows),
                   block=row_block(p))


def _rope(node: Tensor, b: BindingOf) -> list[Launch]:
    x, pos, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    return _launch("rope", "flare_rope", _size(x.shape) // 2, node, x, pos, out,
                   ints=(1 if node.params.get("neox", True) else 0,), floats=(node.params.get("base", 10000.0),))


def _conv1d(node: Tensor, b: BindingOf, tuning: Tuning = None) -> list[Launch]:
    """conv1d as one tiled GEMM (M = Cout, K = Cin*Kw, N = batch*Lout), or one thread per output
    (`naive`)."""
    x, w, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    p = node.params
    conv = (p.get("stride", 1), p.get("padding", 0), p.get("dilation", 1))
    variant = (tuning or {}).get("conv1d")
    if variant == "naive":
        return _launch("conv", "flare_conv1d", _size(out.shape), node, x, w, out, ints=conv)
    cout, cin, kw = w.shape[-3:]
    n = _size(out.shape[:-2]) * out.shape[-1]
    tile = MM_TILES.get(variant or "", "l" if min(cout, n) >= 512 else "m" if min(cout, n) >= 64 else "s")
    side = MM_TILE_SIZE[tile]
    flags = 0
    if w.dtype == "f32" and w.is_contiguous:
        flags |= 2
        if (cin * kw) % 4 == 0 and _aligned4(w):
            flags |= 1
    grid = (-(-n // side), -(-cout // side), 1)
    return _launch("conv", f"flare_conv_{tile}", _size(out.shape), node, x, w, out, ints=(*conv, flags),
                   grid=grid, block=(256, 1, 1))


def _mul_mat_id(node: Tensor, b: BindingOf, tuning: Tuning = None) -> list[Launch]:
    w, x, ids = (b(s) for s in node.srcs)
    out = b(node)
    t, k = ids.shape
    if _size(out.shape) == 0:
        return []
    if len(x.shape) == 2:  # [T, K] used by every selected expert: stride 0 over k
        lx = (x, (t, k, x.shape[1]), (x.strides[0], 0, x.strides[1]))
    else:
        lx = x
    kdim, n = w.shape[-1], w.shape[-2]
    pairs = t * k
    gy = min(max(pairs, 1), MAX_GRID)
    grid = (-(-n // MV_OUTPUTS_PER_BLOCK), gy, -(-pairs // gy))
    if is_quant(w.dtype):  # matmul_q.cu's matrix-vector kernels per (token, slot): 8-bit x, or float (naive)
        naive = (tuning or {}).get("mul_mat_id") == "naive"
        return _launch("matmul_q", f"flare_mvq{'' if naive else '8'}_id_{w.dtype}", pairs, node, w, lx, ids, out,
                       grid=grid, block=(256, 1, 1))
    if w.strides[-1] != 1 or w.dtype not in ("f32", "f16") or (tuning or {}).get("mul_mat_id") == "naive":
        return _launch("matmul", "flare_mul_mat_id", _size(out.shape), node, w, lx, ids, out)
    vec = 2 if kdim % 4 == 0 and _aligned4(w, w.strides[-2], w.strides[-3]) else 0
    return _launch("matmul", "flare_mv_id_h" if w.dtype == "f16" else "flare_mv_id", pairs, node, w, lx, ids, out,
                   ints=(vec,), grid=grid, block=(256, 1, 1))


# lstm.cu keeps h (double-buffered) and c in static shared memory: 3 * 2048 floats = 24 KiB,
# under the 48 KiB a block may declare statically; larger hidden sizes are declined.
LSTM_MAX_HIDDEN = 2048    # lstm.cu LSTM_MAX_H
LSTM_MAX_WARPS = 8        # one warp per hidden unit at a time: at most 256 threads


def lstm_block(hidden: int) -> tuple[int, int, int]:
    """Threads of lstm.cu's block: one warp per hidden unit, at most LSTM_MAX_WARPS warps."""
    return (32 * min(LSTM_MAX_WARPS, hidden), 1, 1)


def _lstm(node: Tensor, b: BindingOf) -> list[Launch]:
    """The whole recurrence in one launch, one block per batch row (lstm.cu)."""
    x, w, h0, c0 = (b(s) for s in node.srcs)
    out = b(node)
    steps, batch, _ = out.shape
    if steps == 0:
        return []
    return _launch("lstm", "flare_lstm", batch, node, x, w, h0, c0, out,
                   grid=row_grid(batch), block=lstm_block(w.shape[1]))


def _copy(node: Tensor, b: BindingOf) -> list[Launch]:
    x, out = b(node.srcs[0]), b(node)
    return _launch("layout", "flare_copy", _size(x.shape), node, x, out, ints=(0,))


def _copy_into(node: Tensor, b: BindingOf) -> list[Launch]:
    dst, src = b(node.srcs[0]), b(node.srcs[1])
    return _launch("layout", "flare_copy", _size(src.shape), node, src, dst, ints=(node.params.get("offset", 0),))


def _pad(node: Tensor, b: BindingOf) -> list[Launch]:
    x, out = b(node.srcs[0]), b(node)
    before = [0] * (4 - len(x.shape)) + [int(p[0]) for p in node.params["pads"]]
    mode = 1 if node.params.get("mode", "constant") == "reflect" else 0
    return _launch("layout", "flare_pad", _size(out.shape), node, x, out,
                   ints=(*before, mode), floats=(node.params.get("value", 0.0),))


def _concat(node: Tensor, b: BindingOf) -> list[Launch]:
    x, y, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    rank = len(out.shape)
    axis = node.params["axis"] % rank + (4 - rank)
    return _launch("layout", "flare_concat", _size(out.shape), node, x, y, out, ints=(axis,))


def _reduce(node: Tensor, b: BindingOf) -> list[Launch]:
    x, out = b(node.srcs[0]), b(node)
    axis = node.params.get("axis", -1) % len(x.shape)
    outer = tuple(1 if a == axis else d for a, d in enumerate(x.shape))
    length, stride = x.shape[axis], x.strides[axis]
    if length == 0 and node.op in ("argmax", "max"):
        raise ValueError(f"node {node.name!r}: {node.op} over an empty axis")
    count = _size(outer)
    return _launch("reduce", "flare_reduce", count, node, (x, outer, x.strides), out,
                   ints=(REDUCE_CODES[node.op], length, stride), grid=row_grid(count), block=row_block(length))


def _view(node: Tensor, b: BindingOf) -> list[Launch]:
    return []  # views alias their source: the planner's binding already says where


LOWERINGS: dict[str, Callable[[Tensor, BindingOf], list[Launch]]] = {
    **{op: _unary for op in UNARY_CODES},
    **{op: _binary for op in BINARY_CODES},
    "matmul": _matmul,
    "layer_norm": _norm, "rms_norm": _norm,
    # fused ops (flare.core.fusion makes them only where supports() says yes)
    "linear": _linear, "norm_affine": _norm, "attention": _attention,
    "softmax": _softmax,
    "get_rows": _get_rows, "dequantize": _dequantize, "set_rows": _set_rows, "gather": _gather, "top_k": _top_k,
    "rope": _rope, "conv1d": _conv1d, "mul_mat_id": _mul_mat_id, "lstm": _lstm,
    "contiguous": _copy, "cast": _copy, "copy_into": _copy_into,
    "pad": _pad, "concat": _concat,
    **{op: _reduce for op in REDUCE_CODES},
    **{op: _view for op in VIEW_OPS},
}


def supported(node: Tensor) -> bool:
    """Whether a node has a kernel (or is a view, which needs none)."""
    if node.op not in LOWERINGS:
        return False
    if any(is_quant(s.dtype) for s in node.srcs) and not _quant_fits(node):
        return False
    if not 1 <= len(node.shape) <= 4 or any(not 1 <= len(s.shape) <= 4 for s in node.srcs):
        return False
    if node.op in ("argmax", "max") and any(d == 0 for d in node.srcs[0].shape):
        return False
    if node.op == "attention":
        q, k = node.srcs[0], node.srcs[1]
        return k.shape[-2] <= ATTENTION_MAX_KEYS and q.shape[-1] <= ATTENTION_MAX_DIM
    if node.op == "lstm":  # f32 only (the op's contract); h and c must fit lstm.cu's shared rows
        return node.srcs[1].shape[1] <= LSTM_MAX_HIDDEN and node.shape[1] <= MAX_GRID * MAX_GRID
    return True


TUNED = frozenset({"matmul", "linear", "conv1d", "mul_mat_id"})  # lowerings that read the split's tuning


def lower(node: Tensor, binding_of: BindingOf, tuning: Tuning = None) -> list[Launch]:
    """The launches that compute `node` with the tensors where `binding_of` says, using
    the kernel variants `tuning` names (op -> variant; unknown names are ignored)."""
    try:
        fn = LOWERINGS[node.op]
    except KeyError:
        raise ValueError(f"node {node.name!r}: op {node.op!r} has no CUDA kernel") from None
    if node.op in TUNED:
        return fn(node, binding_of, tuning)  # type: ignore[call-arg]
    return fn(node, binding_of)


def lower_all(nodes, binding_of: BindingOf, tuning: Tuning = None) -> list[Launch]:
    """Launch plan of a split, in node order."""
    plan: list[Launch] = []
    for node in nodes:
        plan.extend(lower(node, binding_of, tuning))
    return plan
