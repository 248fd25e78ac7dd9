"""NumPy kernels for block-quantized weights (the CPU's fallback path for them).

`dequantize_blocks` unpacks ggml's layouts with the same float32 operations in
the same order as ggml's reference C (so the result is bit-identical to
`gguf.quants`, the registry's reference, without calling it: the conformance
suite compares two implementations). The ops that read quantized weights
(matmul's right operand, linear's weight, get_rows' table, mul_mat_id's
experts) dequantize those weights into a temporary and run the float kernel;
the native executor's integer-dot kernels are the fast path where they exist.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from flare.core.dtypes import QUANT_TYPES, from_numpy

from .kernels import KERNELS, VARIANTS, Kernel, kernel

_LO_HI = np.array([0, 4], np.uint8)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] values: low nibbles first, then high nibbles (ggml's order)."""
    return ((qs[:, None, :] >> _LO_HI[None, :, None]) & 0x0F).reshape(qs.shape[0], -1)


def _f(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _f(b["d"])[:, None]
    return d * _f(_nibbles(b["qs"]).astype(np.int8) - np.int8(8))


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f(b["d"])[:, None] * _f(_nibbles(b["qs"])) + _f(b["m"])[:, None]


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f(b["qs"]) * _f(b["d"])[:, None]


def _k4_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a q4_k super-block (ggml's get_scale_min_k4)."""
    q = scales.astype(np.uint8)
    sc = np.empty((q.shape[0], 8), np.uint8)
    mn = np.empty((q.shape[0], 8), np.uint8)
    sc[:, :4], mn[:, :4] = q[:, 0:4] & 63, q[:, 4:8] & 63
    sc[:, 4:] = (q[:, 8:12] & 0x0F) | ((q[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return sc, mn


def _q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc, mn = _k4_scale_min(b["scales"])
    d = (_f(b["d"])[:, None] * _f(sc))[:, :, None]          # [n, 8, 1]: 32 weights per scale
    m = (_f(b["dmin"])[:, None] * _f(mn))[:, :, None]
    qs = b["qs"].reshape(n, 4, 32)                            # 4 chunks of 64 weights, 32 bytes each
    q = ((qs[:, :, None, :] >> _LO_HI[None, None, :, None]) & 0x0F).reshape(n, 8, 32)
    return (d * _f(q) - m).reshape(n, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b["ql"].reshape(n, 2, 64)                            # two halves of 128 weights
    qh = b["qh"].reshape(n, 2, 32)
    lo = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)        # [n, 2, 4, 32]
    d = (_f(b["d"])[:, None] * _f(b["scales"])).reshape(n, 16, 1)   # a scale per 16 weights
    return (d * _f(q.reshape(n, 16, 16))).reshape(n, 256)


_DEQUANT = {"q4_0": _q4_0, "q4_1": _q4_1, "q8_0": _q8_0, "q4_k": _q4_k, "q6_k": _q6_k}
assert set(_DEQUANT) == set(QUANT_TYPES), "a block type without a CPU dequantization"


def dequantize_blocks(blocks: np.ndarray) -> np.ndarray:
    """[..., n_blocks] blocks (a structured array of a Flare block dtype) -> float32 [..., n_blocks * block]."""
    dtype = from_numpy(blocks.dtype)
    flat = np.ascontiguousarray(blocks).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        values = _DEQUANT[dtype](flat) if flat.size else np.zeros((0, QUANT_TYPES[dtype].block_size), np.float32)
    return values.reshape(*blocks.shape[:-1], blocks.shape[-1] * QUANT_TYPES[dtype].block_size)


@kernel("dequantize")
def _dequantize(out, x, p):
    out[...] = dequantize_blocks(x[0])


def _reading_blocks(float_kernel: Kernel, pos: int) -> Kernel:
    """`float_kernel` with source `pos` dequantized first when it holds blocks."""
    def run(out: np.ndarray, x: Sequence[np.ndarray], p: Mapping[str, Any]) -> None:
        if x[pos].dtype.names:
            x = list(x)
            x[pos] = dequantize_blocks(x[pos])
        float_kernel(out, x, p)
    run.__doc__ = float_kernel.__doc__
    return run


def _get_rows_blocks(float_kernel: Kernel) -> Kernel:
    """get_rows of a quantized table: gather the rows' blocks, then dequantize only those."""
    def run(out: np.ndarray, x: Sequence[np.ndarray], p: Mapping[str, Any]) -> None:
        if x[0].dtype.names:
            out[...] = dequantize_blocks(x[0][x[1]])
        else:
            float_kernel(out, x, p)
    return run


KERNELS["get_rows"] = _get_rows_blocks(KERNELS["get_rows"])
for _op, _pos in (("matmul", 1), ("linear", 1), ("mul_mat_id", 0)):
    KERNELS[_op] = _reading_blocks(KERNELS[_op], _pos)
    for _name, _fn in list(VARIANTS.get(_op, {}).items()):
        VARIANTS[_op][_name] = _reading_blocks(_fn, _pos)
