"""Expand ONNX *function* ops the lowering table lacks into their own definitions.

Many ONNX ops (SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss, Attention,
MeanVarianceNormalization, ...) are defined by the standard as a function: a
small graph of simpler ops, kept in the op schema (`onnx.defs`). Where the
importer has no lowering of its own for such an op, the node is replaced by
that graph — the standard's definition, not a hand copy — before lowering.
Context-dependent functions need their inputs' types: they come from
`onnx.shape_inference` over the model.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterable

from .loader import DEFAULT_DOMAINS

MAX_ROUNDS = 4  # bodies may use other function ops; expand a few levels deep


def expand_functions(proto: Any, opset: int, lowered: Iterable[str]) -> Any:
    """A copy of `proto` whose function ops outside `lowered` are inlined (unchanged if none)."""
    import onnx

    lowered = set(lowered)
    if not any(_function_of(n, opset, lowered) for n in proto.graph.node):
        return proto
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    counter = itertools.count()
    for _ in range(MAX_ROUNDS):
        types = _value_types(model)
        new_nodes, changed = [], False
        for node in model.graph.node:
            schema = _function_of(node, opset, lowered)
            body = _body(schema, node, opset, types) if schema is not None else None
            if body is None:
                new_nodes.append(node)
                continue
            changed = True
            new_nodes.extend(_inline(node, body, schema, next(counter)))
        if not changed:
            break
        del model.graph.node[:]
        model.graph.node.extend(new_nodes)
    return model


def _function_of(node: Any, opset: int, lowered: set[str]):
    import onnx

    if node.domain not in DEFAULT_DOMAINS or node.op_type in lowered:
        return None
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except Exception:
        return None
    if schema.has_function or schema.has_context_dependent_function:
        return schema
    return None


def _value_types(model: Any) -> dict[str, Any]:
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    g = inferred.graph
    types = {v.name: v.type for v in itertools.chain(g.input, g.value_info, g.output)}
    for t in g.initializer:
        tp = onnx.TypeProto()
        tp.tensor_type.elem_type = t.data_type
        for d in t.dims:
            tp.tensor_type.shape.dim.add().dim_value = d
        types.setdefault(t.name, tp)
    return types


def _body(schema: Any, node: Any, opset: int, types: dict[str, Any]):
    import onnx

    try:
        if schema.has_function:
            raw = schema.get_function_with_opset_version(opset) if hasattr(schema, "get_function_with_opset_version") \
                else schema.function_body
            if isinstance(raw, bytes):
                f = onnx.FunctionProto()
                f.ParseFromString(raw)
                return f if f.node else None
            return raw
        ins = []
        for name in node.input:
            tp = types.get(name)
            if name and tp is None:
                return None  # the function's body depends on types inference could not give
            ins.append((tp or onnx.TypeProto()).SerializeToString())
        raw = schema.get_context_dependent_function_with_opset_version(opset, node.SerializeToString(), ins)
        f = onnx.FunctionProto()
        f.ParseFromString(raw)
        return f if f.node else None
    except Exception:
        return None


def _inline(node: Any, body: Any, schema: Any, serial: int) -> list:
    """The body's nodes with formal names bound to the node's actual inputs, outputs and attributes."""
    import onnx

    rename = {}
    for formal, actual in zip(body.input, node.input):
        rename[formal] = actual
    for formal in list(body.input)[len(node.input):]:
        rename[formal] = ""
    for formal, actual in zip(body.output, node.output):
        rename[formal] = actual
    prefix = f"{node.name or node.op_type}__fn{serial}/"
    given = {a.name: a for a in node.attribute}
    defaults = {name: a.default_value for name, a in schema.attributes.items()
                if a.default_value is not None and a.default_value.name}
    out = []
    for i, inner in enumerate(body.node):
        n = onnx.NodeProto()
        n.CopyFrom(inner)
        n.name = f"{prefix}{inner.name or inner.op_type}_{i}"
        n.input[:] = [rename.get(x, prefix + x) if x else "" for x in inner.input]
        n.output[:] = [rename.get(x, prefix + x) if x else "" for x in inner.output]
        del n.attribute[:]
        outer = lambda x: rename.get(x, prefix + x)  # noqa: E731
        for a in inner.attribute:
            if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) and not a.ref_attr_name:
                b = onnx.AttributeProto()
                b.CopyFrom(a)
                for g in ([b.g] if b.type == onnx.AttributeProto.GRAPH else list(b.graphs)):
                    _rename_outer(g, outer)
                n.attribute.append(b)
            elif a.ref_attr_name:
                src = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
                if src is None:
                    continue
                b = onnx.AttributeProto()
                b.CopyFrom(src)
                b.name = a.name
                n.attribute.append(b)
            else:
                n.attribute.append(a)
        out.append(n)
    return out


def _rename_outer(graph: Any, outer: Any) -> None:
    """Rename, in place, the values a subgraph (a Scan/Loop/If body) reads from outside it."""
    local = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        node.input[:] = [x if not x or x in local else outer(x) for x in node.input]
        for a in node.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                _rename_outer(g, lambda x, local=frozenset(local): x if x in local else outer(x))
        local.update(o for o in node.output if o)
    for o in graph.output:
        if o.name not in local:
            o.name = outer(o.name)
