"""Flare's runtime: run model compute graphs on CPU, Vulkan and CUDA through plugins.

The lifecycle is prepare -> execute -> reset -> release, owned by a
`PreparedGraph` that a `Session` hands out. See README.md and docs/design.md.

The public API is what `__all__` lists, importable from here (`from flare.core
import Session`); docs/design.md ("Public API and stability") says which
modules plugin authors may rely on. Attributes are loaded on first use, so
`import flare.core` stays cheap for `flare --help` and plugin discovery.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# name -> module that defines it
_PUBLIC = {
    # lifecycle
    "Session": "session", "PreparedGraph": "prepared", "GraphWorkspace": "workspace",
    # graphs
    "Graph": "graph", "GraphBuilder": "graph", "Tensor": "graph",
    # plugin interfaces
    "Backend": "backend", "Device": "backend", "Buffer": "backend", "BufferType": "backend",
    "Binding": "backend", "MemoryInfo": "backend", "PreparedSplit": "backend", "ProbeResult": "backend",
    "SplitProgram": "backend", "BackendSpec": "specs", "ModelSpec": "specs", "ModelGraph": "specs",
    "CommandSpec": "specs", "hookimpl": "plugin_manager",
    # placement callbacks: `devices` they receive, a preference the scheduler may overrule
    "PlacementDevices": "partition", "Prefer": "partition",
    # memory accounting
    "LEDGER": "ledger",
    # errors
    "FlareError": "errors", "AllocationError": "errors", "BackendUnavailable": "errors",
    "CoreFormatError": "errors", "DTypeError": "errors", "GraphError": "errors", "InputError": "errors",
    "ModelError": "errors", "PlacementError": "errors", "PluginError": "errors", "ReleasedError": "errors",
    "ShapeError": "errors",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'flare.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
