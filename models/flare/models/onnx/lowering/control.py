"""Scan and Loop, unrolled into the trace: each iteration runs the body's nodes once.

A segment has no loops, and the shapes the trace binds fix Scan's iteration
count (the scanned axis) and most Loops' (the trip count, or a condition read
on the host each iteration: a host step). So the body's nodes are stepped like
an If branch's, once per iteration, with the iteration's values bound to the
body's input names; per-iteration slices come from Gather, the stacked outputs
from Unsqueeze and Concat (their own lowerings). Values that outlive an
iteration are kept live under names of their own, so a segment that closes
inside the body (a host step) computes them rather than losing them.
Large trip counts make large segments: the unrolled body is the price of
having no loop construct in a Flare graph.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import OnnxError
from ..values import Val
from .base import LOWERINGS, cval, lowers

MAX_ITERATIONS = 4096  # an unrolled body per iteration: beyond this the trace itself is the problem


def _call(tr, op_type: str, ins: list, **attrs: Any) -> Val:
    """One ONNX op through its own lowering (or folded when every input is a constant)."""
    from onnx import helper

    node = helper.make_node(op_type, [f"in{i}" for i in range(len(ins))], ["out"], **attrs)
    if all(v.is_const and not v.runtime for v in ins):
        from .base import fold

        return fold(tr, node, ins)[0]
    return LOWERINGS[op_type](tr, node, ins, dict(attrs))[0]


def _keep(tr, v: Val, label: str) -> Val:
    """Keep v live past the current iteration under its own name (see the module docstring)."""
    if v.tensor is not None:
        name = f"{label}@{tr.position}"
        v.name = name
        tr.live_tensors[name] = v
        tr.last_use[name] = tr.position
    return v


def _run_body(tr, graph: Any, bound: list[Val], suffix: str) -> list[Val]:
    """Bind the body's inputs, step its nodes, return its outputs (copies, as an If branch does).

    The body runs under names of its own per iteration (`suffix`): a segment keys its leaves
    and weights by value name, and an iteration's constants differ from the last one's."""
    if len(bound) != len(graph.input):
        raise OnnxError(f"body {graph.name!r} takes {len(graph.input)} inputs, the loop gives {len(bound)}")
    graph = _renamed(graph, suffix)
    for inp, v in zip(graph.input, bound):
        tr.env[inp.name] = Val(inp.name, v.shape, v.dtype, const=v.const, tensor=v.tensor, runtime=v.runtime,
                               fixed=v.fixed)
        if v.tensor is not None:
            tr.live_tensors[inp.name] = tr.env[inp.name]
        tr.last_use[inp.name] = tr.position
    return tr.run_branch(graph)


def _renamed(graph: Any, suffix: str) -> Any:
    """A copy of `graph` whose own values (inputs, initializers, node outputs) end in `suffix`,
    read under those names by its nodes and by the subgraphs inside them."""
    import onnx

    g = onnx.GraphProto()
    g.CopyFrom(graph)
    own = {v.name for v in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output if o}
    new = {name: f"{name}{suffix}" for name in own}
    for v in g.input:
        v.name = new[v.name]
    for t in g.initializer:
        t.name = new[t.name]
    for v in g.output:
        v.name = new.get(v.name, v.name)
    _rename_reads(g.node, new)
    for n in g.node:
        n.output[:] = [new.get(o, o) for o in n.output]
    return g


def _rename_reads(nodes: Any, new: dict[str, str]) -> None:
    for n in nodes:
        n.input[:] = [new.get(x, x) for x in n.input]
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                shadowed = {v.name for v in sub.input} | {t.name for t in sub.initializer} | \
                    {o for m in sub.node for o in m.output}
                inner = {k: v for k, v in new.items() if k not in shadowed}
                _rename_reads(sub.node, inner)
                for v in sub.output:
                    v.name = inner.get(v.name, v.name)


def _stack(tr, slices: list[Val], axis: int, reverse: bool) -> Val:
    """The per-iteration outputs stacked along a new `axis` (in reverse order for a reversed scan)."""
    if reverse:
        slices = slices[::-1]
    rank = len(slices[0].shape) + 1
    axis = axis % rank
    parts = [_call(tr, "Unsqueeze", [s, cval(np.array([axis], dtype=np.int64))]) for s in slices]
    return parts[0] if len(parts) == 1 else _call(tr, "Concat", parts, axis=axis)


@lowers("Scan")
def _scan(tr, node, ins, attrs):
    if tr.opset < 9:
        raise OnnxError("Scan before opset 9 (a batch axis and sequence_lens) is not supported")
    body = attrs["body"]
    m = int(attrs["num_scan_inputs"])
    n = len(ins) - m
    states, scanned = list(ins[:n]), list(ins[n:])
    in_axes = list(attrs.get("scan_input_axes", [0] * m))
    in_dirs = list(attrs.get("scan_input_directions", [0] * m))
    k = len(body.output) - n
    out_axes = list(attrs.get("scan_output_axes", [0] * k))
    out_dirs = list(attrs.get("scan_output_directions", [0] * k))
    lengths = {v.shape[a % len(v.shape)] for v, a in zip(scanned, in_axes)}
    if len(lengths) != 1:
        raise OnnxError(f"scan inputs have different lengths {sorted(lengths)}")
    steps = lengths.pop()
    if not 0 < steps <= MAX_ITERATIONS:
        raise OnnxError(f"{steps} iterations (1..{MAX_ITERATIONS} are unrolled)")
    collected: list[list[Val]] = [[] for _ in range(k)]
    for i in range(steps):
        slices = []
        for v, axis, rev in zip(scanned, in_axes, in_dirs):
            index = steps - 1 - i if rev else i
            slices.append(_call(tr, "Gather", [v, cval(np.array(index, dtype=np.int64))], axis=axis % len(v.shape)))
        outs = _run_body(tr, body, states + slices, f"#{node.output[0]}{i}")
        states = [_keep(tr, v, f"{node.output[j] or 'state'}#{j}") for j, v in enumerate(outs[:n])]
        for j, v in enumerate(outs[n:]):
            collected[j].append(_keep(tr, v, f"{node.output[n + j]}#{i}"))
    stacked = [_stack(tr, c, a, bool(d)) for c, a, d in zip(collected, out_axes, out_dirs)]
    return states + stacked


@lowers("Loop")
def _loop(tr, node, ins, attrs):
    """Iterations while the trip count lasts and the condition holds (each read on the host)."""
    body = attrs["body"]
    trip = None if ins[0] is None else int(np.asarray(tr.c(ins[0])).reshape(-1)[0])
    cond = ins[1] if len(ins) > 1 else None
    states = list(ins[2:])
    n = len(states)
    k = len(body.output) - 1 - n
    collected: list[list[Val]] = [[] for _ in range(k)]
    i = 0
    while (trip is None or i < trip) and (cond is None or bool(np.asarray(tr.c(cond)).reshape(-1)[0])):
        if i >= MAX_ITERATIONS:
            raise OnnxError(f"more than {MAX_ITERATIONS} iterations (they are unrolled)")
        cond_in = cond if cond is not None else cval(np.array(True))
        outs = _run_body(tr, body, [cval(np.array(i, dtype=np.int64)), cond_in] + states, f"#{node.output[0]}{i}")
        cond = _keep(tr, outs[0], f"{node.name or 'loop'}#cond")
        states = [_keep(tr, v, f"{node.output[j] or 'state'}#{j}") for j, v in enumerate(outs[1:1 + n])]
        for j, v in enumerate(outs[1 + n:]):
            collected[j].append(_keep(tr, v, f"{node.output[n + j]}#{i}"))
        i += 1
    if k and not i:
        raise OnnxError("no iterations: its scan outputs would be empty (zero-size tensors are not supported)")
    return states + [_stack(tr, c, 0, False) for c in collected]
