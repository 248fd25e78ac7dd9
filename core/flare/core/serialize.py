"""Graphs to and from plain JSON-able dicts (exported cores store their programs so).

Weights are stored by name only; `graph_from_dict` takes a mapping from weight
name to an array or a loader. Every field read from a dict is checked: a
malformed graph raises `CoreFormatError` naming the field (`graph.tensors[3].op`),
and op rules are re-checked by the registry as the graph is rebuilt, so a file
can never produce a graph the builder would have refused. Nothing is unpickled.

A graph with dims (`GraphBuilder.dim`) stores them as `"dims": {name: [input,
axis]}` and each param set to a `Dim` as `{"dim": name}`; `graph_from_dict(...,
sizes=)` and the builder of `builder_from_dict` rebuild it with those input axes
smaller (every shape re-inferred by the op rules), so one stored program runs
at each size with a plan per size.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .dtypes import DTYPES
from .errors import CoreFormatError, GraphError, InputError
from .graph import INPUT, INTERMEDIATE, MAX_RANK, ROLES, WEIGHT, Dim, Graph, Tensor
from .ops import OPS

FORMAT = 1


def _jsonable(value: Any) -> Any:
    if isinstance(value, Dim):
        return {"dim": value.dim_name}
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
    out = {"format": FORMAT, "tensors": tensors, "outputs": {k: t.id for k, t in graph.outputs.items()}}
    if graph.dims:
        out["dims"] = {name: [inp, axis] for name, (inp, axis) in graph.dims.items()}
    return out


def _need(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise CoreFormatError(message, field)


def graph_dims(data: Any, where: str = "graph") -> dict[str, tuple[str, int, int]]:
    """The dims of a serialized graph: name -> (input, axis, declared size); CoreFormatError
    naming the field when malformed or naming no axis of a declared input."""
    dims = data.get("dims", {}) if isinstance(data, dict) else {}
    _need(isinstance(dims, dict), f"{where}.dims", "must be an object")
    if not dims:
        return {}
    items = data.get("tensors")
    inputs = {t["name"]: t.get("shape") for t in items if isinstance(t, dict) and t.get("role") == INPUT
              and isinstance(t.get("name"), str)} if isinstance(items, list) else {}
    out = {}
    for name, ref in dims.items():
        f = f"{where}.dims.{name}"
        _need(isinstance(ref, list) and len(ref) == 2 and isinstance(ref[0], str) and isinstance(ref[1], int)
              and not isinstance(ref[1], bool), f, "must be [input name, axis]")
        shape = inputs.get(ref[0])
        _need(isinstance(shape, list) and 0 <= ref[1] < len(shape) and isinstance(shape[ref[1]], int), f,
              f"names no axis of an input: {ref}")
        out[name] = (ref[0], ref[1], shape[ref[1]])
    return out


def _resolve(value: Any, sizes: Mapping[str, int], field: str) -> Any:
    """A param value with `{"dim": name}` references replaced by `Dim`s of the sizes in use."""
    if isinstance(value, dict) and set(value) == {"dim"}:
        _need(isinstance(value["dim"], str) and value["dim"] in sizes, field, f"refers to dim {value['dim']!r}, which the graph does not declare")
        return Dim(sizes[value["dim"]], value["dim"])
    return value


def graph_from_dict(data: Any, weights: Mapping[str, np.ndarray | Callable[[], np.ndarray]] | None = None,
                    where: str = "graph", sizes: Mapping[str, int] | None = None) -> Graph:
    """Rebuild a graph; raises CoreFormatError naming the bad field. `sizes` gives some dims a
    size other than the declared one (1..declared; InputError outside): the inputs take it and
    every op's shape is re-inferred (the stored shapes hold for the declared sizes only)."""
    _need(isinstance(data, dict), where, "must be an object")
    _need(data.get("format") == FORMAT, f"{where}.format", f"must be {FORMAT}, got {data.get('format')!r}")
    items = data.get("tensors")
    _need(isinstance(items, list) and items, f"{where}.tensors", "must be a non-empty list")
    weights = weights or {}
    dims = graph_dims(data, where)
    values = {name: declared for name, (_, _, declared) in dims.items()}
    for name, size in (sizes or {}).items():
        if name not in dims:
            raise InputError(f"{where}: no dim {name!r} (dims: {sorted(dims)})")
        if not 1 <= int(size) <= dims[name][2]:
            raise InputError(f"{where}: dim {name!r} ({dims[name][0]} axis {dims[name][1]}) may be 1.."
                             f"{dims[name][2]}, asked for {size}")
        values[name] = int(size)
    resized = any(values[n] != d for n, (_, _, d) in dims.items())
    axes = {(inp, axis): values[n] for n, (inp, axis, _) in dims.items()}
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
            if role == INPUT:
                shape = [axes.get((name, axis), d) for axis, d in enumerate(shape)]
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
            params = {k: _resolve(v, values, f"{f}.params.{k}") for k, v in params.items()}
            try:
                params = OPS[op].with_defaults(name, params)
                t = OPS[op].make(name, [by_id[s] for s in srcs], params, tid)
            except GraphError as exc:
                raise CoreFormatError(str(exc), f"{f}") from None
            except (TypeError, ValueError, KeyError, IndexError) as exc:
                raise CoreFormatError(f"{type(exc).__name__}: {exc}", f"{f}.params") from None
            _need((resized or list(t.shape) == shape) and t.dtype == dtype, f"{f}.shape",
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
    graph = Graph(tensors, out, {n: (inp, axis) for n, (inp, axis, _) in dims.items()})
    try:
        graph.validate()
    except GraphError as exc:
        raise CoreFormatError(str(exc), where) from None
    return graph


def builder_from_dict(data: Mapping[str, Any], weights: Mapping[str, Any] | None = None, where: str = "graph"):
    """An entry-point builder (for Session.prepare) that replays a serialized graph.

    The graph's input shapes are fixed but for its dims (axes it declares variable): preparing
    it for other shapes is an InputError; a smaller size of a dim replays the graph at that
    size (cached per sizes; a core has few: the caller buckets them).
    """
    graph = graph_from_dict(data, weights, where)
    dims = graph_dims(data, where)
    by_axis = {(inp, axis): name for name, (inp, axis, _) in dims.items()}
    resized: dict[tuple, Graph] = {}

    def build(b, shapes):
        sizes: dict[str, int] = {}
        for name, t in graph.inputs.items():
            if name not in shapes or tuple(shapes[name]) == t.shape:
                continue
            want = tuple(shapes[name])
            fixed = [a for a in range(len(t.shape)) if (name, a) not in by_axis]
            if len(want) != len(t.shape) or any(want[a] != t.shape[a] for a in fixed):
                raise InputError(f"{where}: input {name!r} is fixed at {t.shape}, asked for {want}")
            for a in range(len(t.shape)):
                if (name, a) in by_axis:
                    sizes[by_axis[(name, a)]] = want[a]
        g = graph
        if sizes:
            key = tuple(sorted(sizes.items()))
            if key not in resized:
                resized[key] = graph_from_dict(data, weights, where, sizes)
            g = resized[key]
        b._tensors.extend(g.tensors)
        b._names.update(t.name for t in g.tensors)
        b._outputs.update(g.outputs)
        b._dims.update(g.dims)

    build.graph = graph  # type: ignore[attr-defined]
    return build
