"""Flare's dtypes: f32 compute, f16 storage, i32/i64 indices, and ggml's block-quantized types.

A quantized dtype is a *block* dtype: one element of a `q4_1` tensor is one
20-byte block holding 32 weights (ggml's `block_q4_1`). A quantized tensor's
last axis therefore counts blocks, and it holds `shape[-1] * block_size(dtype)`
weights per row: a [576, 576] weight in Q4_1 is a tensor of shape [576, 18].
Keeping the block as the unit lets the planner, bindings, views of whole rows
and every device's buffers treat quantized weights like any other tensor
(bytes = elements * itemsize); only the ops that read them (matmul's right
operand, get_rows' table, mul_mat_id's experts, dequantize) know the layout.

The layouts are ggml's (`ggml-common.h`), byte for byte, so GGUF tensors are
used as they are in the file, and the NumPy structured dtype of each names its
fields (`d`, `m`, `qs`...). Little-endian, no padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockType:
    """A ggml block-quantized type: `block_size` weights in `numpy.itemsize` bytes."""

    name: str
    ggml_type: int      # GGMLQuantizationType value (gguf), as GGUF files store it
    block_size: int
    numpy: np.dtype

    @property
    def block_bytes(self) -> int:
        return self.numpy.itemsize


QK = 32      # weights per block of the legacy types
QK_K = 256   # weights per super-block of the k-quants

QUANT_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("q4_0", 2, QK, np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])),
    BlockType("q4_1", 3, QK, np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (QK // 2,))])),
    BlockType("q8_0", 8, QK, np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])),
    BlockType("q4_k", 12, QK_K, np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)),
                                          ("qs", "u1", (QK_K // 2,))])),
    BlockType("q6_k", 14, QK_K, np.dtype([("ql", "u1", (QK_K // 2,)), ("qh", "u1", (QK_K // 4,)),
                                          ("scales", "i1", (QK_K // 16,)), ("d", "<f2")])),
)}
assert [QUANT_TYPES[n].block_bytes for n in ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k")] == [18, 20, 34, 144, 210]

DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    **{name: t.numpy for name, t in QUANT_TYPES.items()},
}
FLOAT = ("f32", "f16")
INDEX = ("i32", "i64")
QUANT = tuple(QUANT_TYPES)


def to_numpy(dtype: str) -> np.dtype:
    """NumPy dtype of a Flare dtype name (a structured block dtype for the quantized ones)."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}") from None


def from_numpy(dtype) -> str:
    """Flare dtype name of a NumPy dtype (float64 is *not* silently accepted)."""
    dt = np.dtype(dtype)
    for name, npdt in DTYPES.items():
        if npdt == dt:
            return name
    raise ValueError(f"dtype {dt} is not a Flare dtype ({', '.join(DTYPES)})")


def itemsize(dtype: str) -> int:
    """Bytes of one element (of one block, for a quantized dtype)."""
    return to_numpy(dtype).itemsize


def is_quant(dtype: str) -> bool:
    return dtype in QUANT_TYPES


def block_size(dtype: str) -> int:
    """Weights per element: the block size of a quantized dtype, else 1."""
    t = QUANT_TYPES.get(dtype)
    return t.block_size if t is not None else 1


def quant_type_of_ggml(ggml_type: int) -> BlockType | None:
    """The block type GGUF calls `ggml_type`, or None when Flare has no kernels for it."""
    return next((t for t in QUANT_TYPES.values() if t.ggml_type == ggml_type), None)
