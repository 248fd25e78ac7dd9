"""Flare: run model compute graphs on CPU, Vulkan and CUDA through plugins.

The lifecycle is prepare -> execute -> reset -> release, owned by a
`PreparedGraph` that a `Session` hands out. See README.md and docs/design.md.
"""
from .errors import (AllocationError, BackendUnavailable, CoreFormatError, DTypeError, FlareError,
                     GraphError, InputError, ModelError, PlacementError, PluginError, ReleasedError,
                     ShapeError)
from .graph import Graph, GraphBuilder, Tensor
from .ledger import LEDGER

__version__ = "0.1.0"
__all__ = [
    "AllocationError", "BackendUnavailable", "CoreFormatError", "DTypeError", "FlareError", "GraphError",
    "InputError", "ModelError", "PlacementError", "PluginError", "ReleasedError", "ShapeError",
    "Graph", "GraphBuilder", "Tensor", "LEDGER", "__version__",
]
