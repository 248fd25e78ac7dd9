"""Graphs to and from plain JSON-able dicts (exported cores store their programs so).

Weights are stored by name only; `graph_from_dict` takes a mapping from weight
name to an array or a loader. Every field read from a dict is checked: a
malformed graph raises `CoreFormatError` naming the field (`graph.tensors[3].op`),
and op rules are re-checked by the registry as the graph is rebuilt, so a file
can never produce a graph the builder would have refused. Nothing is unpickled.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .dtypes import DTYPES
from .errors import CoreFormatError, GraphError
from .graph import INTERMEDIATE, MAX_RANK, ROLES, WEIGHT, Graph, Tensor
from .ops import OPS

FORMAT = 1


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise GraphError(f"param value {value!r} of type {type(value).__name__} cannot be serialized")


def graph_to_dict(graph: Graph) -> dict[str, Any]:
    """A JSON-able description of `graph` (weights by name, no data)."""
    tensors = []
    for t in graph.tensors:
        entry: dict[str, Any] = {"id": t.id, "name": t.name, "shape": list(t.shape), "dtype": t.dtype}
        if t.op is None:
            entry["role"] = t.role
        else:
            entry["op"] = t.op
            entry["srcs"] = [s.id for s in t.srcs]
            entry["params"] = _jsonable(t.params)
        tensors.append(entry)
    return {"format": FORMAT, "tensors": tensors, "outputs": {k: t.id for k, t in graph.outputs.items()}}


def _need(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise CoreFormatError(message, field)


def graph_from_dict(data: Any, weights: Mapping[str, np.ndarray | Callable[[], np.ndarray]] | None = None,
                    where: str = "graph") -> Graph:
    """Rebuild a graph; raises CoreFormatError naming the bad field."""
    _need(isinstance(data, dict), where, "must be an object")
    _need(data.get("format") == FORMAT, f"{where}.format", f"must be {FORMAT}, got {data.get('format')!r}")
    items = data.get("tensors")
    _need(isinstance(items, list) and items, f"{where}.tensors", "must be a non-empty list")
    weights = weights or {}
    by_id: dict[int, Tensor] = {}
    tensors: list[Tensor] = []
    for i, item in enumerate(items):
        f = f"{where}.tensors[{i}]"
        _need(isinstance(item, dict), f, "must be an object")
        tid, name = item.get("id"), item.get("name")
        _need(isinstance(tid, int) and not isinstance(tid, bool), f"{f}.id", "must be an integer")
        _need(tid not in by_id, f"{f}.id", f"duplicate id {tid}")
        _need(isinstance(name, str) and name, f"{f}.name", "must be a non-empty string")
        shape = item.get("shape")
        _need(isinstance(shape, list) and 1 <= len(shape) <= MAX_RANK
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape),
              f"{f}.shape", f"must be 1..{MAX_RANK} non-negative integers")
        dtype = item.get("dtype")
        _need(isinstance(dtype, str) and dtype in DTYPES, f"{f}.dtype", f"must be one of {sorted(DTYPES)}")
        if "op" not in item:
            role = item.get("role")
            _need(isinstance(role, str) and role in ROLES and role != INTERMEDIATE, f"{f}.role", "must be input, weight, state or cache")
            t = Tensor(tid, name, tuple(shape), dtype, role)
            if role == WEIGHT:
                _need(name in weights, f"{f}.name", f"weight {name!r} is missing from the weights")
                t.data = weights[name]
        else:
            op = item["op"]
            _need(isinstance(op, str) and op in OPS, f"{f}.op", f"unknown op {op!r}")
            srcs = item.get("srcs")
            _need(isinstance(srcs, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in srcs),
                  f"{f}.srcs", "must be a list of ids")
            for s in srcs:
                _need(s in by_id, f"{f}.srcs", f"source id {s} is not defined before this tensor")
            params = item.get("params", {})
            _need(isinstance(params, dict), f"{f}.params", "must be an object")
            try:
                params = OPS[op].with_defaults(name, params)
                t = OPS[op].make(name, [by_id[s] for s in srcs], params, tid)
            except GraphError as exc:
                raise CoreFormatError(str(exc), f"{f}") from None
            except (TypeError, ValueError, KeyError, IndexError) as exc:
                raise CoreFormatError(f"{type(exc).__name__}: {exc}", f"{f}.params") from None
            _need(list(t.shape) == shape and t.dtype == dtype, f"{f}.shape",
                  f"declared {shape} {dtype}, op {op} gives {list(t.shape)} {t.dtype}")
        by_id[tid] = t
        tensors.append(t)
    outputs = data.get("outputs")
    _need(isinstance(outputs, dict) and outputs, f"{where}.outputs", "must be a non-empty object")
    out: dict[str, Tensor] = {}
    for k, v in outputs.items():
        _need(isinstance(v, int) and v in by_id, f"{where}.outputs.{k}", f"unknown tensor id {v!r}")
        by_id[v].is_output = True
        out[k] = by_id[v]
    graph = Graph(tensors, out)
    try:
        graph.validate()
    except GraphError as exc:
        raise CoreFormatError(str(exc), where) from None
    return graph


def builder_from_dict(data: Mapping[str, Any], weights: Mapping[str, Any] | None = None, where: str = "graph"):
    """An entry-point builder (for Session.prepare) that replays a serialized graph.

    The graph's input shapes are fixed; preparing it for other shapes is an InputError.
    """
    graph = graph_from_dict(data, weights, where)

    def build(b, shapes):
        from .errors import InputError

        for name, t in graph.inputs.items():
            if name in shapes and tuple(shapes[name]) != t.shape:
                raise InputError(f"{where}: input {name!r} is fixed at {t.shape}, asked for {tuple(shapes[name])}")
        b._tensors.extend(graph.tensors)
        b._names.update(t.name for t in graph.tensors)
        b._outputs.update(graph.outputs)

    build.graph = graph  # type: ignore[attr-defined]
    return build
