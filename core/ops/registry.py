"""The op registry: one place that knows each op's rule, aliasing and reference.

An `OpDef` answers three questions for everyone else:
- the graph builder: what shape and dtype does this op produce (or which
  ShapeError/DTypeError, naming the node)?
- the memory planner: may the output reuse src0's memory (`inplace`), is it a
  view of src0 (`view`), does it write into src0 (`writes_src0`)?
- the conformance suite: what does NumPy say the answer is (`reference`)?
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import DTypeError, GraphError, ShapeError

# infer(name, srcs, params) -> (shape, dtype)
InferFn = Callable[[str, Sequence[Any], Mapping[str, Any]], tuple[tuple[int, ...], str]]
# view(name, src, params) -> (shape, strides, offset) in elements, relative to src's layout
ViewFn = Callable[[str, Any, Mapping[str, Any]], tuple[tuple[int, ...], tuple[int, ...], int]]
RefFn = Callable[[Sequence[np.ndarray], Mapping[str, Any]], np.ndarray]


@dataclass(frozen=True)
class OpDef:
    """Everything the framework knows about one op."""

    name: str
    n_srcs: tuple[int, int]
    infer: InferFn
    reference: RefFn
    defaults: Mapping[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    inplace: bool = False
    view: ViewFn | None = None
    writes_src0: bool = False
    doc: str = ""
    fused: bool = False  # made by the fusion pass from a chain; a backend may leave it unsupported

    def with_defaults(self, node: str, params: Mapping[str, Any]) -> dict[str, Any]:
        unknown = set(params) - set(self.defaults) - set(self.required)
        if unknown:
            raise GraphError(f"{self.name}: unknown params {sorted(unknown)}", node)
        missing = [p for p in self.required if p not in params]
        if missing:
            raise GraphError(f"{self.name}: missing params {missing}", node)
        return {**self.defaults, **params}

    def check(self, node: str, srcs: Sequence[Any], params: Mapping[str, Any]):
        """Validate arity and rule; returns (shape, dtype). Raises naming `node`."""
        lo, hi = self.n_srcs
        if not lo <= len(srcs) <= hi:
            want = str(lo) if lo == hi else f"{lo}..{hi}"
            raise GraphError(f"{self.name} takes {want} inputs, got {len(srcs)}", node)
        shape, dtype = self.infer(node, srcs, params)
        shape = tuple(int(d) for d in shape)
        if not 1 <= len(shape) <= 4:
            raise ShapeError(f"{self.name} would produce rank {len(shape)} (1..4 supported)", node)
        return shape, dtype

    def make(self, node: str, srcs: list[Any], params: dict[str, Any], tensor_id: int):
        """Create the output tensor of this op (used by the builder and deserializer)."""
        from ..graph import INTERMEDIATE, Tensor

        shape, dtype = self.check(node, srcs, params)
        out = Tensor(tensor_id, node, shape, dtype, INTERMEDIATE, self.name, tuple(srcs), dict(params))
        if self.view is not None:
            vshape, vstrides, voffset = self.view(node, srcs[0], params)
            out.shape, out.strides = tuple(vshape), tuple(vstrides)
            out.offset = srcs[0].offset + voffset
            out.view_of = srcs[0]
        elif self.writes_src0:
            out.view_of = srcs[0]
            out.offset = srcs[0].offset
            out.strides = srcs[0].strides
        return out


OPS: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    """Add an op to the registry; a second op with the same name is a bug."""
    if opdef.name in OPS:
        raise ValueError(f"op {opdef.name!r} registered twice")
    OPS[opdef.name] = opdef
    return opdef


# ---- helpers shared by op definitions -----------------------------------

def need_dtype(node: str, op: str, t: Any, allowed: Sequence[str]) -> None:
    if t.dtype not in allowed:
        raise DTypeError(f"{op}: input {t.name!r} has dtype {t.dtype}, expected {'/'.join(allowed)}", node)


def need_rank(node: str, op: str, t: Any, ranks: Sequence[int]) -> None:
    if len(t.shape) not in ranks:
        raise ShapeError(f"{op}: input {t.name!r} has shape {t.shape}, expected rank {'/'.join(map(str, ranks))}", node)


def norm_axis(node: str, op: str, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ShapeError(f"{op}: axis {axis} out of range for rank {rank}", node)
    return axis % rank


def broadcast(node: str, op: str, *shapes: Sequence[int]) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        raise ShapeError(f"{op}: shapes {' and '.join(str(tuple(s)) for s in shapes)} do not broadcast", node) from None
