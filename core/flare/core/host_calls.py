"""Host nodes: a split of one `host` node runs a Python callback between device splits.

The callback (`PreparedGraph(callbacks={name: fn})`, or a model's `stage_experts`)
gets the node, its inputs read back to the host and `ctx` (the PreparedGraph, for
`write_rows`/`state` during the execute) and returns an array of the node's shape,
which is written to the node's output.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .backend import Binding, Device
from .dtypes import to_numpy
from .errors import InputError
from .partition import Split

HostCallback = Callable[..., np.ndarray]


def run_host(owner: str, split: Split, bindings: Mapping[int, Binding], device: Device,
             callbacks: Mapping[str, HostCallback], ctx: Any) -> None:
    node = split.nodes[0]
    cb = callbacks.get(node.params["callback"])
    if cb is None:
        raise InputError(f"{owner}: no host callback {node.params['callback']!r} for node {node.name!r}")
    arrays = [device.read(bindings[s.id]) for s in node.srcs]
    result = np.asarray(cb(node, *arrays, ctx=ctx))
    if result.shape != node.shape:
        raise InputError(f"host callback {node.params['callback']!r} returned {result.shape}, node {node.name!r} expects {node.shape}")
    device.write(bindings[node.id], result.astype(to_numpy(node.dtype), copy=False))
