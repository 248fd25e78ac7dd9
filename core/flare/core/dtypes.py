"""The four dtypes Flare knows: f32 compute, f16 storage, i32/i64 indices."""
from __future__ import annotations

import numpy as np

DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
}
FLOAT = ("f32", "f16")
INDEX = ("i32", "i64")


def to_numpy(dtype: str) -> np.dtype:
    """NumPy dtype of a Flare dtype name."""
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
    return to_numpy(dtype).itemsize
