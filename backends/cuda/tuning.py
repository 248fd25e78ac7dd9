"""Kernel variants of the CUDA backend, and timing them on a device to choose one.

A variant is another kernel for the same node with the same result up to
rounding: for `matmul` the output tile of the shared-memory GEMM (`t32`,
`t64`, `t128`: 32x32, 64x64, 128x128 per block of 256 threads) or the generic
one-thread-per-output kernel (`naive`); for `mul_mat_id` the matrix-vector
kernel (`mv`) or `naive`. A split reads its choice from `SplitProgram.tuning`
(op -> variant, from an exported core's tuning profile through
`Session.prepare(tuning={entry: {"cuda.matmul": "t64"}})`); without one,
`lowering.matmul_plan` picks by shape.

`measure()` times each variant of one node on a device with its operands
already there (replays of a one-node CUDA graph, best of `repeats`), after
checking every variant against the first: what a tuning pass at export time
runs on the target GPU.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from flare.backend import Binding, SplitProgram
from flare.dtypes import itemsize, to_numpy
from flare.graph import Graph

from .lowering import MM_VARIANTS

VARIANTS: dict[str, tuple[str, ...]] = {"matmul": MM_VARIANTS, "mul_mat_id": ("mv", "naive")}


def variants(op: str) -> tuple[str, ...]:
    """The variant names a tuning profile may give for `op` on CUDA (() if it has one kernel)."""
    return VARIANTS.get(op, ())


def measure(device: Any, graph: Graph, inputs: Mapping[str, np.ndarray], repeats: int = 5,
            rtol: float = 1e-4, atol: float = 1e-4, names: Sequence[str] | None = None,
            outputs: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """Best seconds per variant for the one tunable node of `graph` (a graph built around it).

    `names`: the variants to time (default: all; "default" is the untuned plan).
    Every variant must agree with the first on the outputs (else ValueError): a
    choice never changes what is computed beyond rounding. The first variant's
    outputs are stored in `outputs` when given."""
    ops = {n.op for n in graph.nodes} & set(VARIANTS)
    if len(ops) != 1:
        raise ValueError(f"measure() wants a graph with one tunable op, found {sorted(ops) or 'none'}")
    op = ops.pop()
    buffers, bindings = {}, {}
    try:
        for t in graph.tensors:
            st = t.storage
            if st.id not in buffers:
                buffers[st.id] = device.alloc(st.nbytes, st.name)
            bindings[t.id] = Binding(buffers[st.id], t.offset * itemsize(t.dtype), t.shape, t.strides, t.dtype)
        for name, arr in inputs.items():
            device.write(bindings[graph.inputs[name].id], np.asarray(arr, to_numpy(graph.inputs[name].dtype)))
        for t in graph.weights.values():
            device.write(bindings[t.id], np.asarray(t.host_data()))
        seconds: dict[str, float] = {}
        first: dict[str, np.ndarray] | None = None
        names = tuple(names or VARIANTS[op])
        for variant in names:
            tuned = {} if variant == "default" else {op: variant}
            split = device.compile(SplitProgram(device, graph.nodes, bindings, tuned))
            try:
                split.run()
                outs = {n: device.read(bindings[t.id]) for n, t in graph.outputs.items()}
                if first is None:
                    first = outs
                    if outputs is not None:
                        outputs.update(outs)
                for n, got in outs.items():
                    if not np.allclose(got, first[n], rtol=rtol, atol=atol, equal_nan=True):
                        raise ValueError(f"CUDA {op} variant {variant!r} disagrees with "
                                         f"{names[0]!r} on output {n!r}")
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    split.run()
                    best = min(best, time.perf_counter() - t0)
                seconds[variant] = best
            finally:
                split.release()
        return seconds
    finally:
        for buf in buffers.values():
            buf.release()


def choose(seconds: Mapping[str, float]) -> str:
    """The fastest variant (ties: the earlier name)."""
    names = list(seconds)
    return min(names, key=lambda v: (seconds[v], names.index(v)))
