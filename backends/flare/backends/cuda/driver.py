"""Thin helpers over `cuda.bindings.driver`: lazy import and result checking.

The bindings return `(CUresult, *values)` from every call. `call()` unpacks
that and turns a failure into a `CudaError` that names the call and the
result, so no error code is ever dropped on the floor (ggml once ignored one
and segfaulted on a null buffer).
"""
from __future__ import annotations

from typing import Any

from flare.core.errors import FlareError

SUCCESS = "CUDA_SUCCESS"
OUT_OF_MEMORY = "CUDA_ERROR_OUT_OF_MEMORY"
NO_DEVICE = "CUDA_ERROR_NO_DEVICE"


class CudaError(FlareError):
    """A driver call failed; `status` is the CUresult name (e.g. CUDA_ERROR_OUT_OF_MEMORY)."""

    def __init__(self, what: str, status: str):
        self.what = what
        self.status = status
        super().__init__(f"{what} failed: {status}")


def load() -> Any:
    """The `cuda.bindings.driver` module (ImportError when cuda-bindings is missing).

    Importing the module does not load libcuda; the first call does, and raises
    (cuda.pathfinder's DynamicLibNotFoundError) when there is no driver."""
    from cuda.bindings import driver

    return driver


def status_name(status: Any) -> str:
    return getattr(status, "name", None) or str(status)


def call(result: Any, what: str) -> Any:
    """Unpack `(status, *values)`; raise CudaError unless status is CUDA_SUCCESS.

    Returns None, the single value, or a tuple of values."""
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    if int(status) != 0:
        raise CudaError(what, status_name(status))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def version_tuple(driver_version: int) -> tuple[int, int]:
    """cuDriverGetVersion's integer (e.g. 12080) as (12, 8)."""
    return driver_version // 1000, (driver_version % 1000) // 10
