"""The op registry (`OPS`): shape/dtype rules, aliasing and NumPy references.

Importing this package registers every built-in op. See docs/ops.md.
"""
from .registry import OPS, OpDef, register
from . import elementwise, linalg, shape, reduce, nn, host, fused, quant  # noqa: F401  (registration)
from . import math_ops, indexing, spatial  # noqa: F401  (registration: the ops imported ONNX graphs need)

__all__ = ["OPS", "OpDef", "register"]
