"""Fusion at prepare time: merge op chains into the fused ops of `flare.core.ops.fused`.

Why: on a native backend the cost of a small node is its memory pass, not an
interpreter step; a matmul's epilogue (bias, activation, residual) and a norm's
affine tail are cheapest done while the row is still in cache.

The pass rewrites a freshly built graph in place. A chain qualifies when each
of its intermediate tensors has exactly one reader, is no graph output and is
not viewed; the chain's last node becomes the fused node (it keeps its id and
readers, and takes the name of the chain's first node, the matmul or the norm,
which is what placement callbacks route by) and the others leave the graph. A
chain is fused only when `accept(candidate, chain)` says so: the runtime fuses
after partitioning, only chains whose nodes all landed on one device that
`supports` the fused node, and then partitions again with those nodes pinned
there; so a backend without the fused op simply keeps the original nodes.

Chains:
- matmul -> [add a row of N (bias)] -> [gelu | relu | sigmoid] -> [add a tensor of
  the output's shape (residual)]: `linear`, when at least one step follows the matmul.
- layer_norm | rms_norm -> mul by a row of the last axis -> [add such a row]: `norm_affine`.
- matmul(q, k, transpose_b) -> softmax(scale[, mask]) -> matmul(., v): `attention`.
- relu(x) -> scale(1 - alpha) -> add(scale(x, alpha), .): `leaky_relu` (the ONNX
  importer's LeakyRelu); the scale of x, read by that add alone, leaves too.
- conv2d over one row (H = 1) -> [reshape dropping that axis] -> add a tensor of
  that shape (residual): `conv_add`. The reshape is a view of the convolution's
  output read by the add alone (how a 1-D Conv is imported); it leaves with it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from .graph import Graph, Tensor

Accept = Callable[[Tensor, list[Tensor]], bool]  # (candidate fused node, the chain it replaces)
_ACTS = ("gelu", "relu", "sigmoid")


@dataclass(frozen=True)
class Fusion:
    """One merge: the fused node's name and op, and the nodes it replaced (in order)."""

    node: str
    op: str
    replaced: tuple[str, ...]
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.op}{f'[{self.detail}]' if self.detail else ''} {self.node} <- {' + '.join(self.replaced)}"


class _Chains:
    def __init__(self, graph: Graph):
        self.consumers = graph.consumers()
        self.outputs = {t.id for t in graph.outputs.values()}

    def sole_reader(self, t: Tensor, view_ok: bool = False) -> Tensor | None:
        """The only node reading `t`, if `t` is a private intermediate (no output, and no view
        unless `view_ok`: a chain may pass through a view only where its pattern says so)."""
        readers = self.consumers.get(t.id, [])
        if len(readers) != 1 or t.id in self.outputs or t.is_output or (t.view_of is not None and not view_ok):
            return None
        reader = readers[0]
        if sum(1 for s in reader.srcs if s is t) != 1:
            return None
        return reader


def _other(node: Tensor, t: Tensor) -> Tensor:
    return node.srcs[1] if node.srcs[0] is t else node.srcs[0]


def _is_row(t: Tensor, n: int) -> bool:
    return tuple(t.shape) == (n,) and t.dtype == "f32"


def _linear(mm: Tensor, chains: _Chains) -> tuple[list[Tensor], list[Tensor], dict] | None:
    chain, cur = [mm], mm
    bias = residual = None
    act = "none"
    n = mm.shape[-1]
    while residual is None:
        nxt = chains.sole_reader(cur)
        if nxt is None:
            break
        if nxt.op == "add":
            other = _other(nxt, cur)
            if bias is None and act == "none" and _is_row(other, n):
                bias = other
            elif tuple(other.shape) == tuple(mm.shape) and other.dtype == "f32":
                residual = other
            else:
                break
        elif nxt.op in _ACTS and act == "none":
            act = nxt.op
        else:
            break
        chain.append(nxt)
        cur = nxt
    if len(chain) == 1:
        return None
    srcs = list(mm.srcs) + ([bias] if bias is not None else []) + ([residual] if residual is not None else [])
    params = {"transpose_b": mm.params["transpose_b"], "act": act, "has_bias": bias is not None,
              "has_residual": residual is not None}
    return chain, srcs, params


def _norm_affine(norm: Tensor, chains: _Chains) -> tuple[list[Tensor], list[Tensor], dict] | None:
    d = norm.shape[-1]
    mul = chains.sole_reader(norm)
    if mul is None or mul.op != "mul" or not _is_row(_other(mul, norm), d):
        return None
    chain, srcs = [norm, mul], [norm.srcs[0], _other(mul, norm)]
    add = chains.sole_reader(mul)
    if add is not None and add.op == "add" and _is_row(_other(add, mul), d):
        chain.append(add)
        srcs.append(_other(add, mul))
    params = {"norm": norm.op.split("_")[0], "eps": norm.params["eps"], "has_beta": len(srcs) == 3}
    return chain, srcs, params


def _attention(scores: Tensor, chains: _Chains) -> tuple[list[Tensor], list[Tensor], dict] | None:
    if not scores.params["transpose_b"] or len(scores.shape) < 3:
        return None
    soft = chains.sole_reader(scores)
    if soft is None or soft.op != "softmax" or soft.srcs[0] is not scores:
        return None
    ctx = chains.sole_reader(soft)
    if ctx is None or ctx.op != "matmul" or ctx.srcs[0] is not soft or ctx.params["transpose_b"]:
        return None
    srcs = [scores.srcs[0], scores.srcs[1], ctx.srcs[1], *soft.srcs[1:]]
    return [scores, soft, ctx], srcs, {"scale": soft.params["scale"], "has_mask": len(soft.srcs) == 2}


def _scales(t: Tensor) -> float | None:
    """The factor of a bias-free scale node, else None."""
    if t.op != "scale" or float(t.params.get("bias", 0.0)) != 0.0:
        return None
    return float(t.params["scale"])


def _leaky_relu(relu: Tensor, chains: _Chains) -> tuple[list[Tensor], list[Tensor], dict] | None:
    x = relu.srcs[0]
    pos = chains.sole_reader(relu)
    if pos is None or _scales(pos) is None:
        return None
    add = chains.sole_reader(pos)
    if add is None or add.op != "add":
        return None
    neg = _other(add, pos)
    alpha = _scales(neg)
    if alpha is None or neg.srcs[0] is not x or chains.sole_reader(neg) is not add or x.dtype != "f32" \
            or abs(alpha + _scales(pos) - 1.0) > 1e-6 or tuple(add.shape) != tuple(x.shape):
        return None
    return [relu, pos, neg, add], [x], {"alpha": alpha}


def _conv_add(conv: Tensor, chains: _Chains) -> tuple[list[Tensor], list[Tensor], dict] | None:
    if len(conv.shape) != 4 or conv.shape[2] != 1 or conv.dtype != "f32":
        return None
    chain, cur = [conv], conv
    nxt = chains.sole_reader(conv)
    if nxt is not None and nxt.op == "reshape" and nxt.view_of is conv \
            and tuple(nxt.shape) == (conv.shape[0], conv.shape[1], conv.shape[3]):
        chain.append(nxt)
        cur = nxt
        nxt = chains.sole_reader(cur, view_ok=True)
    if nxt is None or nxt.op != "add":
        return None
    res = _other(nxt, cur)
    if tuple(res.shape) != tuple(cur.shape) or res.dtype != "f32" or tuple(nxt.shape) != tuple(cur.shape):
        return None
    params = {**conv.params, "has_bias": len(conv.srcs) == 3}
    return chain + [nxt], [*conv.srcs, res], params


def _matmul_chain(mm: Tensor, chains: _Chains):
    """A matmul starts an attention chain (q k^T -> softmax -> . v) or a linear one."""
    found = _attention(mm, chains)
    return ("attention", found) if found is not None else ("linear", _linear(mm, chains))


_PATTERNS = {"matmul": ("linear", _linear), "layer_norm": ("norm_affine", _norm_affine),
             "rms_norm": ("norm_affine", _norm_affine), "relu": ("leaky_relu", _leaky_relu),
             "conv2d": ("conv_add", _conv_add)}


def fusion_enabled() -> bool:
    """FLARE_FUSION=0 turns the pass off (to compare fused and unfused runs)."""
    return os.environ.get("FLARE_FUSION", "1").strip().lower() not in ("0", "false", "no", "off")


def fuse(graph: Graph, accept: Accept) -> list[Fusion]:
    """Rewrite `graph` in place; return what was merged (for describe()).

    Chains are disjoint (each intermediate has one reader), so the reader map
    taken before the first rewrite stays valid for the rest."""
    chains = _Chains(graph)
    removed: set[int] = set()
    done: list[Fusion] = []
    for node in graph.nodes:
        if node.id in removed or node.op not in _PATTERNS:
            continue
        op, match = _PATTERNS[node.op]
        if node.op == "matmul":
            op, found = _matmul_chain(node, chains)
        else:
            found = match(node, chains)
        if found is None:
            continue
        chain, srcs, params = found
        last = chain[-1]
        candidate = Tensor(last.id, chain[0].name, last.shape, last.dtype, last.role, op, tuple(srcs), params,
                           last.strides, last.offset, None, last.is_output)
        if not accept(candidate, chain):
            continue
        replaced_last = last.name
        last.op, last.srcs, last.params = op, tuple(srcs), params
        last.name = chain[0].name  # the chain's principal op names it (placement callbacks route by name)
        removed.update(t.id for t in chain[:-1])
        detail = params.get("act", params.get("norm", ""))
        done.append(Fusion(last.name, op, tuple([last.name] + [t.name for t in chain[1:-1]] + [replaced_last]),
                           "" if detail == "none" else detail))
    if removed:
        graph.tensors = [t for t in graph.tensors if t.id not in removed]
    return done
