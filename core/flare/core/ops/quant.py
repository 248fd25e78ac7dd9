"""Block-quantized weights: the `dequantize` op and the reference dequantization.

The reference is the `gguf` package's own `gguf.quants` (llama.cpp's Python
implementation, independent of every Flare kernel): what a backend's
dequantization must reproduce bit for bit, and what the references of matmul,
get_rows and mul_mat_id dequantize with before they multiply in float64.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import QUANT, QUANT_TYPES, block_size, from_numpy
from .registry import OpDef, need_dtype, register


def dequantize_reference(blocks: np.ndarray, dtype: str) -> np.ndarray:
    """[..., n_blocks] blocks of `dtype` -> float32 [..., n_blocks * block_size], by gguf.quants."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(QUANT_TYPES[dtype].ggml_type)
    raw = np.ascontiguousarray(blocks).view(np.uint8)
    if raw.size == 0:
        return np.zeros((*blocks.shape[:-1], blocks.shape[-1] * block_size(dtype)), np.float32)
    return np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(
        *blocks.shape[:-1], blocks.shape[-1] * block_size(dtype))


def as_float(array: np.ndarray) -> np.ndarray:
    """The weights an array holds, as float64: dequantized when its dtype is a block dtype."""
    if array.dtype.names:
        return dequantize_reference(array, from_numpy(array.dtype)).astype(np.float64)
    return array.astype(np.float64)


def logical_shape(t) -> tuple[int, ...]:
    """A tensor's shape in weights: the last axis times the block size for a quantized dtype."""
    return (*t.shape[:-1], t.shape[-1] * block_size(t.dtype))


def _dequantize_infer(node, srcs, params):
    (w,) = srcs
    need_dtype(node, "dequantize", w, QUANT)
    return logical_shape(w), "f32"


def _dequantize_ref(x, p):
    return as_float(x[0]).astype(np.float32)


register(OpDef("dequantize", (1, 1), _dequantize_infer, _dequantize_ref, quant_srcs=(0,),
               doc="block-quantized weights -> f32, ggml's layouts"))
