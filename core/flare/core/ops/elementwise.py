"""Elementwise ops: binary with NumPy broadcasting, scale, and unary activations."""
from __future__ import annotations

import math

import numpy as np

from .registry import OpDef, broadcast, need_dtype, register


def _binary_infer(op):
    def infer(node, srcs, params):
        a, b = srcs
        need_dtype(node, op, a, ("f32",))
        need_dtype(node, op, b, ("f32",))
        return broadcast(node, op, a.shape, b.shape), "f32"
    return infer


for _name, _fn in {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}.items():
    register(OpDef(_name, (2, 2), _binary_infer(_name),
                   (lambda fn: lambda x, p: fn(x[0], x[1]).astype(np.float32))(_fn), inplace=True))


def _unary_infer(op):
    def infer(node, srcs, params):
        need_dtype(node, op, srcs[0], ("f32",))
        return srcs[0].shape, "f32"
    return infer


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (0.5 * x64 * (1.0 + _erf(x64 / math.sqrt(2.0)))).astype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (1.0 / (1.0 + np.exp(-x64))).astype(np.float32)


UNARY_REFERENCES = {
    "relu": lambda x: np.maximum(x, 0).astype(np.float32),
    "gelu": _gelu,
    "silu": lambda x: (x.astype(np.float64) * _sigmoid(x)).astype(np.float32),
    "sigmoid": _sigmoid,
    "tanh": lambda x: np.tanh(x.astype(np.float64)).astype(np.float32),
    "exp": lambda x: np.exp(x.astype(np.float64)).astype(np.float32),
    "sqrt": lambda x: np.sqrt(x.astype(np.float64)).astype(np.float32),
    "neg": lambda x: (-x).astype(np.float32),
    "sqr": lambda x: (x.astype(np.float64) ** 2).astype(np.float32),
}

for _name, _fn in UNARY_REFERENCES.items():
    register(OpDef(_name, (1, 1), _unary_infer(_name), (lambda fn: lambda x, p: fn(x[0]))(_fn), inplace=True))


def _scale_infer(node, srcs, params):
    need_dtype(node, "scale", srcs[0], ("f32",))
    return srcs[0].shape, "f32"


register(OpDef("scale", (1, 1), _scale_infer,
               lambda x, p: (x[0].astype(np.float64) * p["scale"] + p["bias"]).astype(np.float32),
               defaults={"bias": 0.0}, required=("scale",), inplace=True))
