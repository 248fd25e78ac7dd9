"""Evaluate a graph with each op's NumPy reference: the oracle of every test.

Memory semantics mirror a real backend: state leaves are mutable arrays, view
ops return NumPy views, and ops that write into state (`set_rows`,
`copy_into`) update the state array in place, so a node that reads the state
after the write sees the new contents — exactly what a device sees.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .dtypes import to_numpy
from .errors import InputError
from .graph import INPUT, STATE, WEIGHT, Graph
from .ops import OPS

HostCallback = Callable[..., np.ndarray]


def evaluate(
    graph: Graph,
    inputs: Mapping[str, np.ndarray],
    state: Mapping[str, np.ndarray] | None = None,
    callbacks: Mapping[str, HostCallback] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Run `graph` on the host. Returns (outputs, state after the run).

    Missing state starts at zeros; `callbacks` serve `host` nodes
    (`callback(node, *input_arrays, ctx=...) -> array`, where ctx offers
    `write_rows(name, row, array)` and `state(name)` like a PreparedGraph).
    """
    values: dict[int, np.ndarray] = {}
    new_state: dict[str, np.ndarray] = {}
    for t in graph.tensors:
        if t.op is None:
            if t.role == INPUT:
                if t.name not in inputs:
                    raise InputError(f"missing input {t.name!r}")
                arr = np.asarray(inputs[t.name])
                if arr.shape != t.shape:
                    raise InputError(f"input {t.name!r} has shape {arr.shape}, graph expects {t.shape}")
                values[t.id] = arr.astype(to_numpy(t.dtype), copy=False)
            elif t.role == WEIGHT:
                values[t.id] = np.asarray(t.host_data())
            else:  # state / cache: a private mutable copy
                given = (state or {}).get(t.name)
                arr = np.zeros(t.shape, to_numpy(t.dtype)) if given is None else np.array(given, to_numpy(t.dtype))
                values[t.id] = arr
                new_state[t.name] = arr
            continue
        srcs = [values[s.id] for s in t.srcs]
        opdef = OPS[t.op]
        if t.op == "host":
            cb = (callbacks or {}).get(t.params["callback"])
            if cb is None:
                raise InputError(f"no callback {t.params['callback']!r} for host node {t.name!r}")
            out = np.asarray(cb(t, *srcs, ctx=_HostContext(values, graph))).astype(to_numpy(t.dtype)).reshape(t.shape)
        else:
            out = opdef.reference(srcs, t.params)
        if opdef.writes_src0:
            np.copyto(srcs[0], out)
            out = srcs[0]
        values[t.id] = out
    outputs = {name: np.array(values[t.id]) for name, t in graph.outputs.items()}
    return outputs, {k: np.array(v) for k, v in new_state.items()}


class _HostContext:
    """What a host callback may do during reference evaluation (as PreparedGraph offers)."""

    def __init__(self, values: dict[int, np.ndarray], graph: Graph):
        self._values, self._graph = values, graph

    def write_rows(self, name: str, row: int, array: np.ndarray) -> None:
        target = self._values[self._graph.states[name].id]
        rows = np.asarray(array, target.dtype).reshape(-1, *target.shape[1:])
        target[row: row + rows.shape[0]] = rows

    def state(self, name: str) -> np.ndarray:
        return np.array(self._values[self._graph.states[name].id])


def evaluate_node(op: str, srcs: list[np.ndarray], params: Mapping[str, Any]) -> np.ndarray:
    """Reference of a single op (used by conformance cases)."""
    opdef = OPS[op]
    return np.asarray(opdef.reference(srcs, {**opdef.defaults, **params}))
