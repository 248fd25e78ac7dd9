"""Batched matmul (optionally with a transposed right operand)."""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..dtypes import QUANT, is_quant
from .quant import as_float, logical_shape
from .registry import OpDef, broadcast, need_dtype, register


def _matmul_infer(node, srcs, params):
    a, b = srcs
    need_dtype(node, "matmul", a, ("f32",))
    need_dtype(node, "matmul", b, ("f32", "f16", *QUANT))
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise ShapeError(f"matmul needs rank >= 2, got {a.shape} and {b.shape}", node)
    if is_quant(b.dtype) and not params["transpose_b"]:
        raise ShapeError(f"matmul with {b.dtype} weights needs transpose_b (rows of blocks along k)", node)
    m, k = a.shape[-2:]
    bs = logical_shape(b)
    kb, n = (bs[-1], bs[-2]) if params["transpose_b"] else bs[-2:]
    if k != kb:
        raise ShapeError(f"matmul inner dims differ: {a.shape} @ {b.shape} (transpose_b={params['transpose_b']})", node)
    batch = broadcast(node, "matmul", a.shape[:-2], b.shape[:-2])
    return (*batch, m, n), "f32"


def _matmul_ref(x, p):
    a, b = x[0].astype(np.float64), as_float(x[1])
    if p["transpose_b"]:
        b = np.swapaxes(b, -1, -2)
    return np.matmul(a, b).astype(np.float32)


register(OpDef("matmul", (2, 2), _matmul_infer, _matmul_ref, defaults={"transpose_b": False}, quant_srcs=(1,)))
