"""Bring your own ONNX model: an importer that lowers ONNX graphs onto Flare ops.

`load_model(path)` parses and validates a file (`loader`), `OnnxRunner` runs it
on a Flare Session (`runner`: one Flare graph per segment, host steps between
segments where a shape depends on data), `lowering` maps each ONNX op and
opset onto Flare ops, and `backend` wraps it all as an `onnx.backend.base.Backend`
for ONNX's own backend test suite. The runtime itself stays format-free.
"""
from __future__ import annotations

__all__ = ["load_model", "OnnxRunner"]


def __getattr__(name: str):
    if name == "load_model":
        from .loader import load_model
        return load_model
    if name == "OnnxRunner":
        from .runner import OnnxRunner
        return OnnxRunner
    raise AttributeError(name)
