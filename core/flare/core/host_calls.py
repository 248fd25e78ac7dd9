"""Host nodes: a split of one `host` node runs a Python callback between device splits.

The callback (`PreparedGraph(callbacks={name: fn})`, or a model's `stage_experts`)
gets the node, its inputs read back to the host (fresh arrays it may keep) and
`ctx` (the PreparedGraph, for `write_rows`/`state` during the execute) and
returns an array of the node's shape, which is written to the node's output.

A callback with a true attribute `borrows_inputs` promises to neither keep nor
write its input arrays past the call (it copies what it hands on); on a CPU
device it then gets read-only views of the inputs in the graph's own memory,
no copies. The views are valid only during the call: the memory is the
execute's workspace, reused by the nodes after it. A borrowing callback with a
true `fills_output` also gets `out=`, the node's output in the same memory (of
the node's shape and dtype): returning `out` itself says it wrote the result
there, which saves the result's allocation, checks and copy.

A host node runs on every step of a MoE decode loop (expert staging, four
times per step on the GGUF bench-moe file), so `HostStep` resolves at bind
time what does not change between executes: the node's bindings and, on a CPU
device (host memory, no queue to wait for), the NumPy views of its inputs and
output; a run is then the callback (after a copy per input unless it borrows
them) and one copy out.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .backend import Binding, Device
from .dtypes import to_numpy
from .errors import InputError
from .partition import Split

HostCallback = Callable[..., np.ndarray]


class HostStep:
    """One host split of a bound plan (rebuilt whenever the plan is bound again)."""

    def __init__(self, split: Split, bindings: Mapping[int, Binding], device: Device):
        self.node = node = split.nodes[0]
        self.name = node.params["callback"]
        self.device = device
        self.srcs = [bindings[s.id] for s in node.srcs]
        self.out = bindings[node.id]
        self.dtype = to_numpy(node.dtype)
        # CPU memory is written synchronously: its views may be read and written directly
        direct = device.backend == "cpu"
        self.src_views = [device.host_view(b) if direct else None for b in self.srcs]
        self.out_view = device.host_view(self.out) if direct else None
        # what a borrowing callback gets: read-only views (None where the device needs a read)
        self.borrowed = [_read_only(v) for v in self.src_views] if direct else None

    def run(self, owner: str, callbacks: Mapping[str, HostCallback], ctx: Any) -> None:
        """Call the node's callback (`owner`: the graph's name, for messages)."""
        node = self.node
        cb = callbacks.get(self.name)
        if cb is None:
            raise InputError(f"{owner}: no host callback {self.name!r} for node {node.name!r}")
        if self.borrowed is not None and getattr(cb, "borrows_inputs", False):
            if getattr(cb, "fills_output", False):
                out = self.out_view
                result = cb(node, *self.borrowed, ctx=ctx, out=out)
                if result is out:
                    return             # written in place (the view has the node's shape and dtype)
            else:
                result = cb(node, *self.borrowed, ctx=ctx)
        else:
            arrays = [v.copy() if v is not None else self.device.read(b) for v, b in zip(self.src_views, self.srcs)]
            result = cb(node, *arrays, ctx=ctx)
        if type(result) is not np.ndarray:
            result = np.asarray(result)
        if result.shape != node.shape:
            raise InputError(f"host callback {self.name!r} returned {result.shape}, node {node.name!r} expects {node.shape}")
        if self.out_view is not None:
            self.out_view[...] = result   # the CPU device's write (a cast, as astype would, if the dtype differs)
        else:
            self.device.write(self.out, result.astype(self.dtype, copy=False))


def _read_only(view: np.ndarray) -> np.ndarray:
    """A view of `view` that refuses writes (a borrowing callback's inputs)."""
    out = view.view()
    out.flags.writeable = False
    return out


def host_node_step(node: Any, bindings: Mapping[int, Binding], device: Device, host_calls: Any) -> Callable[[], None]:
    """A host node left inside a device's split (`SplitProgram.host_calls`: (callbacks, ctx)) that
    the device runs as a step of the split: the callback, as a host split would run it."""
    if host_calls is None:
        raise InputError(f"host node {node.name!r} inside a device split, but no host callbacks were given")
    callbacks, ctx = host_calls
    step = HostStep(Split(-1, device.name, [node], host=True), bindings, device)
    owner = getattr(ctx, "name", "graph")
    return lambda: step.run(owner, callbacks, ctx)


def run_host(owner: str, split: Split, bindings: Mapping[int, Binding], device: Device,
             callbacks: Mapping[str, HostCallback], ctx: Any) -> None:
    """Run one host split once (no views kept): `HostStep` without the binding-time work."""
    HostStep(split, bindings, device).run(owner, callbacks, ctx)
