"""From graph nodes to kernel launches: which kernel, how many threads, what arguments.

Pure Python over `Binding`s: no driver, no GPU. The same launch plans run on a
CUDA device (captured into a CUDA graph) and in the host emulator (tests), so
everything here is checked against the NumPy references without a GPU.

Conventions shared with kernels/*.cu: tensors are padded to rank 4 on the
left; broadcasting and `transpose_b` are expressed as strides, never copies;
outputs are contiguous; every kernel does one unit of work per thread for
`n` threads in 1-D blocks of `BLOCK`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from flare.backend import Binding
from flare.graph import Tensor

from .args import KArgs, broadcast_strides, fill

BLOCK = 256

# op codes, in step with the enums of elementwise.cu and reduce.cu
UNARY_CODES = {"relu": 0, "gelu": 1, "silu": 2, "sigmoid": 3, "tanh": 4, "exp": 5, "sqrt": 6, "neg": 7, "sqr": 8,
               "scale": 9}
BINARY_CODES = {"add": 0, "sub": 1, "mul": 2, "div": 3}
REDUCE_CODES = {"sum": 0, "mean": 1, "max": 2, "argmax": 3}
VIEW_OPS = frozenset({"slice", "reshape", "permute", "transpose"})

BindingOf = Callable[[Tensor], Binding]


@dataclass
class Launch:
    """One kernel launch: `n` threads of `kernel` (in kernel file `module`) over `args`."""

    module: str
    kernel: str
    n: int
    args: KArgs
    node: str = ""

    @property
    def grid(self) -> tuple[int, int, int]:
        return (max(1, -(-self.n // BLOCK)), 1, 1)

    @property
    def block(self) -> tuple[int, int, int]:
        return (BLOCK, 1, 1)


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _launch(module: str, kernel: str, n: int, node: Tensor, *tensors, ints=(), floats=()) -> list[Launch]:
    """Build one launch; `tensors` are Bindings or (Binding, shape, strides) layouts.

    Returns [] for empty work: a zero-sized tensor needs no kernel."""
    if n <= 0:
        return []
    args = KArgs()
    for slot, t in enumerate(tensors):
        if isinstance(t, tuple):
            fill(args.t[slot], *t)
        else:
            fill(args.t[slot], t)
    args.n = n
    for k, v in enumerate(ints):
        args.i[k] = int(v)
    for k, v in enumerate(floats):
        args.f[k] = float(v)
    return [Launch(module, kernel, n, args, node.name)]


# ---- per-op lowerings ------------------------------------------------------------

def _unary(node: Tensor, b: BindingOf) -> list[Launch]:
    x, out = b(node.srcs[0]), b(node)
    floats = (node.params["scale"], node.params.get("bias", 0.0)) if node.op == "scale" else ()
    return _launch("elementwise", "flare_unary", _size(out.shape), node, x, out,
                   ints=(UNARY_CODES[node.op],), floats=floats)


def _binary(node: Tensor, b: BindingOf) -> list[Launch]:
    x, y, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    lx = (x, out.shape, broadcast_strides(x.shape, x.strides, out.shape))
    ly = (y, out.shape, broadcast_strides(y.shape, y.strides, out.shape))
    return _launch("elementwise", "flare_binary", _size(out.shape), node, lx, ly, out, ints=(BINARY_CODES[node.op],))


def _matmul(node: Tensor, b: BindingOf) -> list[Launch]:
    x, w, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    batch = tuple(out.shape[:-2])
    m, n = out.shape[-2:]
    k = x.shape[-1]
    if node.params.get("transpose_b"):
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
    return _launch("matmul", "flare_matmul", _size(out.shape), node, lx, lw, lo)


def _rows(shape) -> int:
    return _size(shape[:-1]) if len(shape) > 1 else 1


def _norm(node: Tensor, b: BindingOf) -> list[Launch]:
    x, out = b(node.srcs[0]), b(node)
    mode = 0 if node.op == "layer_norm" else 1
    return _launch("norm", "flare_norm", _rows(x.shape) if x.shape[-1] else 0, node, x, out,
                   ints=(mode,), floats=(node.params["eps"],))


def _softmax(node: Tensor, b: BindingOf) -> list[Launch]:
    x, out = b(node.srcs[0]), b(node)
    if len(node.srcs) == 2:
        m = b(node.srcs[1])
        mask = (m, x.shape, broadcast_strides(m.shape, m.strides, x.shape))
        has_mask = 1
    else:
        mask, has_mask = x, 0
    return _launch("norm", "flare_softmax", _rows(x.shape) if x.shape[-1] else 0, node, x, mask, out,
                   ints=(has_mask,), floats=(node.params.get("scale", 1.0),))


def _get_rows(node: Tensor, b: BindingOf) -> list[Launch]:
    table, idx, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    return _launch("index", "flare_get_rows", _size(out.shape), node, table, idx, out)


def _set_rows(node: Tensor, b: BindingOf) -> list[Launch]:
    dst, idx, src = (b(s) for s in node.srcs)
    return _launch("index", "flare_set_rows", _size(src.shape), node, dst, idx, src)


def _gather(node: Tensor, b: BindingOf) -> list[Launch]:
    x, idx, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    return _launch("index", "flare_gather", _size(idx.shape), node, x, idx, out)


def _top_k(node: Tensor, b: BindingOf) -> list[Launch]:
    x, out = b(node.srcs[0]), b(node)
    return _launch("index", "flare_top_k", _rows(x.shape), node, x, out, ints=(node.params["k"],))


def _rope(node: Tensor, b: BindingOf) -> list[Launch]:
    x, pos, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    return _launch("rope", "flare_rope", _size(x.shape) // 2, node, x, pos, out,
                   ints=(1 if node.params.get("neox", True) else 0,), floats=(node.params.get("base", 10000.0),))


def _conv1d(node: Tensor, b: BindingOf) -> list[Launch]:
    x, w, out = b(node.srcs[0]), b(node.srcs[1]), b(node)
    p = node.params
    return _launch("conv", "flare_conv1d", _size(out.shape), node, x, w, out,
                   ints=(p.get("stride", 1), p.get("padding", 0), p.get("dilation", 1)))


def _mul_mat_id(node: Tensor, b: BindingOf) -> list[Launch]:
    w, x, ids = (b(s) for s in node.srcs)
    out = b(node)
    t, k = ids.shape
    if len(x.shape) == 2:  # [T, K] used by every selected expert: stride 0 over k
        lx = (x, (t, k, x.shape[1]), (x.strides[0], 0, x.strides[1]))
    else:
        lx = x
    return _launch("matmul", "flare_mul_mat_id", _size(out.shape), node, w, lx, ids, out)


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
    return _launch("reduce", "flare_reduce", _size(outer), node, (x, outer, x.strides), out,
                   ints=(REDUCE_CODES[node.op], length, stride))


def _view(node: Tensor, b: BindingOf) -> list[Launch]:
    return []  # views alias their source: the planner's binding already says where


LOWERINGS: dict[str, Callable[[Tensor, BindingOf], list[Launch]]] = {
    **{op: _unary for op in UNARY_CODES},
    **{op: _binary for op in BINARY_CODES},
    "matmul": _matmul,
    "layer_norm": _norm, "rms_norm": _norm,
    "softmax": _softmax,
    "get_rows": _get_rows, "set_rows": _set_rows, "gather": _gather, "top_k": _top_k,
    "rope": _rope, "conv1d": _conv1d, "mul_mat_id": _mul_mat_id,
    "contiguous": _copy, "cast": _copy, "copy_into": _copy_into,
    "pad": _pad, "concat": _concat,
    **{op: _reduce for op in REDUCE_CODES},
    **{op: _view for op in VIEW_OPS},
}


def supported(node: Tensor) -> bool:
    """Whether a node has a kernel (or is a view, which needs none)."""
    if node.op not in LOWERINGS:
        return False
    if not 1 <= len(node.shape) <= 4 or any(not 1 <= len(s.shape) <= 4 for s in node.srcs):
        return False
    if node.op in ("argmax", "max") and any(d == 0 for d in node.srcs[0].shape):
        return False
    return True


def lower(node: Tensor, binding_of: BindingOf) -> list[Launch]:
    """The launches that compute `node` with the tensors where `binding_of` says."""
    try:
        fn = LOWERINGS[node.op]
    except KeyError:
        raise ValueError(f"node {node.name!r}: op {node.op!r} has no CUDA kernel") from None
    return fn(node, binding_of)


def lower_all(nodes, binding_of: BindingOf) -> list[Launch]:
    """Launch plan of a split, in node order."""
    plan: list[Launch] = []
    for node in nodes:
        plan.extend(lower(node, binding_of))
    return plan
