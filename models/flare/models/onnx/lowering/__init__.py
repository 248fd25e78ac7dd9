"""ONNX ops -> Flare ops: one function per ONNX op type, opset differences inside it.

`base` holds the registry (`LOWERINGS`, `HOST_STEPS`, `WIDE_OK`), constant
folding and the shared helpers; each family registers its lowerings on import.
"""
from __future__ import annotations

from . import control, elementwise, host, nn, recurrent, reductions, shapes  # noqa: F401  (registration)
from .base import HOST_STEPS, LOWERINGS, WIDE_OK, attributes, cval, fold, merged_broadcast, merged_permutation
from .elementwise import ELEMENTWISE

__all__ = ["HOST_STEPS", "LOWERINGS", "WIDE_OK", "ELEMENTWISE", "attributes", "cval", "fold", "merged_broadcast",
           "merged_permutation"]
