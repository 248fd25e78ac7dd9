"""Values while lowering: an ONNX value is a constant array, or a Flare tensor.

ONNX shapes may be rank 0 (scalars) and booleans are a dtype of their own;
Flare tensors have rank 1..4 and no bool. A `Val` keeps the ONNX view (its
logical shape and NumPy dtype) beside the Flare tensor that holds it: a
scalar is a Flare tensor of shape (1,), a bool one of dtype i32 (0/1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .errors import OnnxError

BOOL = np.dtype(np.bool_)
# ONNX dtypes Flare has no dtype for, and the NumPy dtype that carries them through a segment:
# float64, float16, bfloat16 and the float8/float4 formats are computed in float32 (a Cast to a
# narrow float rounds to it: op round_float; results are converted where they leave the graph),
# the small and unsigned integers (down to 2 bits) in int32/int64 (re-wrapped to their width after
# each arithmetic node: lowering.base._carried). uint64 shares int64's bits: its values of 2**63
# and more compare and divide as negative numbers. The narrow formats are ml_dtypes' dtypes.
_F32, _I32, _I64 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.int64)
NARROW_FLOATS = {np.dtype(getattr(ml_dtypes, n)): n for n in ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
                                                             "float8_e5m2", "float8_e5m2fnuz", "float4_e2m1fn")}
CARRIER = {np.dtype(np.float64): _F32, np.dtype(np.float16): _F32, **{d: _F32 for d in NARROW_FLOATS},
           **{np.dtype(t): _I32 for t in (np.int8, np.uint8, np.int16, np.uint16, ml_dtypes.int4, ml_dtypes.uint4,
                                          ml_dtypes.int2, ml_dtypes.uint2)},
           np.dtype(np.uint32): _I64, np.dtype(np.uint64): _I64}
# NumPy dtype -> the Flare dtype that carries it
FLARE_DTYPE = {np.dtype(np.float32): "f32", np.dtype(np.int64): "i64", np.dtype(np.int32): "i32", BOOL: "i32",
               **{src: {np.dtype(np.float32): "f32", np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}[dst]
                  for src, dst in CARRIER.items()}}


def carrier(dtype: np.dtype) -> np.dtype:
    """The dtype a value of ONNX dtype `dtype` has inside a segment (itself when Flare has it)."""
    dtype = np.dtype(dtype)
    return CARRIER.get(dtype, dtype)


@dataclass
class Val:
    """One ONNX value while a graph is traced.

    `const` is known now: from the file (`fixed`: an initializer, keyed by name
    in plan caches), folded from other constants, or read back from an earlier
    segment (`runtime`: it feeds later segments as an input, never as a weight).
    `tensor` is a node of the segment being built."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    const: np.ndarray | None = None
    tensor: Any = None
    runtime: bool = False
    fixed: bool = False
    carried_from: np.dtype | None = None  # while a lowering runs: the ONNX dtype `dtype` carries

    @property
    def is_const(self) -> bool:
        return self.const is not None


MAX_RANK = 4


def flare_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Flare shape that holds an ONNX shape: scalars become (1,); a *wide* shape
    (rank > 4) is held contiguously with its size-1 axes dropped and, if still
    too many, its leading axes merged (only reshape-like ops and Expand take
    wide values; see lowering.WIDE_OK)."""
    if len(shape) <= MAX_RANK:
        return tuple(shape) if len(shape) else (1,)
    dims = [d for d in shape if d != 1] or [1]
    while len(dims) > MAX_RANK:
        dims[:2] = [dims[0] * dims[1]]
    return tuple(dims)


def is_wide(shape: tuple[int, ...]) -> bool:
    return len(shape) > MAX_RANK


def flare_dtype(dtype: np.dtype, where: str) -> str:
    try:
        return FLARE_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise OnnxError(f"{where}: dtype {np.dtype(dtype).name} has no Flare equivalent "
                        f"(float32/64/16, bfloat16, float8/float4, the integers of 2 to 64 bits and bool do)") from None


def to_flare_array(arr: np.ndarray, where: str) -> np.ndarray:
    """An array as Flare stores it (bool -> int32 0/1, other dtypes in their CARRIER, scalars -> shape (1,))."""
    flare_dtype(arr.dtype, where)
    arr = np.asarray(arr)
    if arr.dtype == BOOL:
        arr = arr.astype(np.int32)
    elif arr.dtype in CARRIER:
        arr = arr.astype(CARRIER[arr.dtype])
    return np.ascontiguousarray(arr.reshape(flare_shape(arr.shape)))


def from_flare_array(arr: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A Flare result back in its ONNX shape and dtype."""
    out = np.asarray(arr).reshape(shape)
    if np.dtype(dtype) == BOOL:
        return out != 0
    return out.astype(dtype, copy=False)


def np_dtype_of(elem_type: int, where: str, strict: bool = True) -> np.dtype | None:
    from onnx import helper

    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception:
        if strict:
            raise OnnxError(f"{where}: ONNX element type {elem_type} is not supported") from None
        return None
