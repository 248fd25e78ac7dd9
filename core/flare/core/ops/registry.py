"""The op registry: one place that knows each op's rule, aliasing and reference.

An `OpDef` answers three questions for everyone else:
- the graph builder: what shape and dtype does this op produce (or which
  ShapeError/DTypeError, naming the node)?
- the memory planner: may the output reuse src0's memory (`inplace`), is it a
  view of src0 (`view`), does it write into src0 (`writes_src0`)?
- the conformance suite: what does NumPy say the answer is (`reference`)?

Op parameters are type-checked against `PARAMS`, one schema per parameter
name (a name means the same thing in every op: `eps` is always a positive
finite float, `axis` always an integer), when a node is made — by the builder
and by the deserializer of an exported core — so a core whose `eps` is NaN or
a string is refused at load with the field named, never at execute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..dtypes import is_quant
from ..errors import DTypeError, GraphError, ShapeError
from ..graph import INTERMEDIATE, Tensor, contiguous_strides

# infer(name, srcs, params) -> (shape, dtype)
InferFn = Callable[[str, Sequence[Any], Mapping[str, Any]], tuple[tuple[int, ...], str]]
# view(name, src, params) -> (shape, strides, offset) in elements, relative to src's layout
ViewFn = Callable[[str, Any, Mapping[str, Any]], tuple[tuple[int, ...], tuple[int, ...], int]]
RefFn = Callable[[Sequence[np.ndarray], Mapping[str, Any]], np.ndarray]


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


F32_MAX = float(np.finfo(np.float32).max)


def _is_num(v: Any) -> bool:
    """A number the f32 kernels can hold: finite, and finite once cast to float32."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
        and math.isfinite(float(v)) and abs(float(v)) <= F32_MAX


def _int_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) <= 8 and all(_is_int(d) for d in v)


def _json_like(v: Any, depth: int = 0) -> bool:
    if depth > 4:
        return False
    if v is None or isinstance(v, (bool, str)) or _is_int(v) or _is_num(v):
        return True
    if isinstance(v, (list, tuple)):
        return len(v) <= 1024 and all(_json_like(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return len(v) <= 64 and all(isinstance(k, str) and _json_like(x, depth + 1) for k, x in v.items())
    return False


# parameter name -> (check, what it must be). Limits are sanity bounds, not model limits.
PARAMS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "axis": (_is_int, "an integer"),
    "axis0": (_is_int, "an integer"),
    "axis1": (_is_int, "an integer"),
    "axes": (_int_list, "a list of integers"),
    "keepdims": (lambda v: isinstance(v, bool), "true or false"),
    "transpose_b": (lambda v: isinstance(v, bool), "true or false"),
    "neox": (lambda v: isinstance(v, bool), "true or false"),
    "eps": (lambda v: _is_num(v) and 0 < float(v) < 1, "a finite float in (0, 1)"),
    "scale": (_is_num, "a number finite in float32"),
    "bias": (_is_num, "a number finite in float32"),
    "value": (_is_num, "a number finite in float32"),
    "alpha": (_is_num, "a number finite in float32"),
    "base": (lambda v: _is_num(v) and 1 < float(v) <= 1e9, "a number in (1, 1e9]"),
    "k": (lambda v: _is_int(v) and 1 <= v <= 1 << 20, "an integer in 1..2^20"),
    "stride": (lambda v: _is_int(v) and 1 <= v <= 1 << 16, "an integer in 1..65536"),
    "dilation": (lambda v: _is_int(v) and 1 <= v <= 1 << 16, "an integer in 1..65536"),
    "padding": (lambda v: _is_int(v) and 0 <= v <= 1 << 16, "an integer in 0..65536"),
    "offset": (lambda v: _is_int(v) and 0 <= v < 1 << 40, "a non-negative integer"),
    "start": (lambda v: v is None or _is_int(v), "an integer or null"),
    "stop": (lambda v: v is None or _is_int(v), "an integer or null"),
    "step": (lambda v: _is_int(v) and 1 <= v, "a positive integer"),
    "shape": (lambda v: _int_list(v) and 1 <= len(v) <= 4 and all(d >= -1 for d in v),
              "a list of 1..4 integers (>= 0, or -1 once in reshape)"),
    "pads": (lambda v: isinstance(v, (list, tuple)) and len(v) <= 4
             and all(isinstance(p, (list, tuple)) and len(p) == 2 and all(_is_int(d) and 0 <= d < 1 << 30 for d in p)
                     for p in v), "a list of [before, after] pairs of non-negative integers"),
    "mode": (lambda v: isinstance(v, str) and 0 < len(v) <= 32, "a short string"),
    "dtype": (lambda v: isinstance(v, str) and 0 < len(v) <= 16, "a dtype name"),
    "callback": (lambda v: isinstance(v, str) and 0 < len(v) <= 256, "a callback name"),
    "args": (lambda v: isinstance(v, dict) and _json_like(v), "an object of plain JSON values"),
}


def check_params(op: str, node: str, params: Mapping[str, Any]) -> None:
    """Type-check every parameter against `PARAMS` (GraphError naming the node and parameter)."""
    for key, value in params.items():
        rule = PARAMS.get(key)
        if rule is None:
            raise GraphError(f"{op}: parameter {key!r} has no schema in the op registry", node)
        ok, what = rule
        try:
            good = bool(ok(value))
        except (TypeError, ValueError, OverflowError):
            good = False
        if not good:
            raise GraphError(f"{op}: parameter {key}={value!r} must be {what}", node)


_KNOWN_PARAMS: dict[str, tuple[Any, frozenset[str]]] = {}  # op name -> (OpDef, its parameter names)

NODE_MEMO_MAX = 4096  # entries per op before its memo starts over (distinct shapes x params seen)


class _NoKey(Exception):
    """A parameter value the node memo does not key (a Dim, a NumPy scalar, a dict): check it in full."""


_BOOL, _FLOAT = object(), object()


def _param_key(value: Any) -> Any:
    """A hashable stand-in for a parameter value that equals another's only when both pass or fail
    the same checks: bools and floats are tagged (True == 1 and 1.0 == 1 in Python, but `keepdims=1`
    or `axis=1.0` must be refused), lists and tuples are tagged and keyed element by element."""
    kind = type(value)
    if kind is int or kind is str or value is None:
        return value
    if kind is bool:
        return (_BOOL, value)
    if kind is float:
        return (_FLOAT, value)
    if kind is list or kind is tuple:
        out = [kind]
        for v in value:
            out.append(v if type(v) is int else _param_key(v))
        return tuple(out)
    raise _NoKey


def _node_key(params: Mapping[str, Any], srcs: Sequence[Any]) -> tuple:
    """`OpDef.node`'s memo key: parameter names and typed values, then each source's shape, dtype
    and strides, in one flat tuple (a node is built per call: no nested tuples, no comprehension)."""
    key: list[Any] = []
    for k, v in params.items():
        key.append(k)
        key.append(v if type(v) is int or type(v) is str else _param_key(v))
    key.append(len(key))  # where the sources begin
    for s in srcs:
        key.append(s.shape)
        key.append(s.dtype)
        key.append(s.strides)
    return tuple(key)


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
    # positions of the sources that may have a block-quantized dtype (flare.core.dtypes.QUANT);
    # every other op refuses them, so no kernel ever sees a block where it expects a number
    quant_srcs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # (params key, sources' shape/dtype/strides) -> what `make` derived from them; not a field
        object.__setattr__(self, "_memo", {})

    def node(self, node: str, srcs: list[Any], params: Mapping[str, Any], tensor_id: int):
        """`make(node, srcs, with_defaults(node, params), tensor_id)`, remembering what succeeded.

        Why: a traced graph (an ONNX model's new input length) builds thousands of nodes whose
        op, parameters and source shapes were all seen before; the checks and the shape rule
        then give the same answer again (~10 us a node). What they read is keyed exactly:
        the given parameters (typed, `_param_key`) and each source's shape, dtype and strides
        (a view's layout follows its source's strides; an op writing into its first source
        also reads that source's role, so those are never remembered). Failures are not
        remembered: a refused node is checked in full every time and raises as before. The
        memo is per op, bounded (`NODE_MEMO_MAX`), and safe to share between threads (one
        dict read or write, under the GIL; a lost write costs a check)."""
        memo = self._memo  # type: ignore[attr-defined]
        try:
            key = _node_key(params, srcs)
            hit = memo.get(key)
        except (_NoKey, TypeError):  # TypeError: an unhashable shape or strides
            key = hit = None
        if hit is None:
            merged = self.with_defaults(node, params)
            out = self.make(node, srcs, merged, tensor_id)
            if key is not None and not self.writes_src0:
                if len(memo) >= NODE_MEMO_MAX:
                    memo.clear()
                view = (out.shape, out.strides, out.offset - srcs[0].offset) if self.view is not None else None
                memo[key] = (out.shape, out.dtype, view)
            return out
        shape, dtype, view = hit
        merged = {**self.defaults, **params}
        if view is None:
            return Tensor(tensor_id, node, shape, dtype, INTERMEDIATE, self.name, tuple(srcs), merged,
                          contiguous_strides(shape))
        vshape, vstrides, voffset = view
        src = srcs[0]
        return Tensor(tensor_id, node, vshape, dtype, INTERMEDIATE, self.name, tuple(srcs), merged,
                      vstrides, src.offset + voffset, src)

    def with_defaults(self, node: str, params: Mapping[str, Any]) -> dict[str, Any]:
        hit = _KNOWN_PARAMS.get(self.name)  # (frozen: a side table, not a field) asked per node built
        if hit is None or hit[0] is not self:
            hit = _KNOWN_PARAMS[self.name] = (self, frozenset(self.defaults) | frozenset(self.required))
        known = hit[1]
        if not known.issuperset(params):
            raise GraphError(f"{self.name}: unknown params {sorted(set(params) - known)}", node)
        missing = [p for p in self.required if p not in params]
        if missing:
            raise GraphError(f"{self.name}: missing params {missing}", node)
        merged = {**self.defaults, **params}
        check_params(self.name, node, merged)
        return merged

    def check(self, node: str, srcs: Sequence[Any], params: Mapping[str, Any]):
        """Validate arity and rule; returns (shape, dtype). Raises naming `node`."""
        lo, hi = self.n_srcs
        if not lo <= len(srcs) <= hi:
            want = str(lo) if lo == hi else f"{lo}..{hi}"
            raise GraphError(f"{self.name} takes {want} inputs, got {len(srcs)}", node)
        for i, src in enumerate(srcs):
            if is_quant(getattr(src, "dtype", "")) and i not in self.quant_srcs:
                raise DTypeError(f"{self.name}: input {src.name!r} is block-quantized ({src.dtype}); only "
                                 f"matmul (right operand), get_rows, mul_mat_id and dequantize read such weights", node)
        shape, dtype = self.infer(node, srcs, params)
        shape = tuple(map(int, shape))
        if not 1 <= len(shape) <= 4:
            raise ShapeError(f"{self.name} would produce rank {len(shape)} (1..4 supported)", node)
        return shape, dtype

    def make(self, node: str, srcs: list[Any], params: dict[str, Any], tensor_id: int):
        """Create the output tensor of this op (used by the builder and deserializer)."""
        shape, dtype = self.check(node, srcs, params)
        if self.view is not None:
            vshape, vstrides, voffset = self.view(node, srcs[0], params)
            return Tensor(tensor_id, node, tuple(vshape), dtype, INTERMEDIATE, self.name, tuple(srcs), dict(params),
                          tuple(vstrides), srcs[0].offset + voffset, srcs[0])
        if self.writes_src0:
            return Tensor(tensor_id, node, shape, dtype, INTERMEDIATE, self.name, tuple(srcs), dict(params),
                          srcs[0].strides, srcs[0].offset, srcs[0])
        return Tensor(tensor_id, node, shape, dtype, INTERMEDIATE, self.name, tuple(srcs), dict(params))


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
    """NumPy's broadcast of `shapes`, in plain Python: asked for every elementwise node a graph
    builds (an ONNX trace builds thousands), where np.broadcast_shapes costs ~25 us a call."""
    rank = max(map(len, shapes), default=0)
    out = [1] * rank
    for s in shapes:
        for i, d in enumerate(s, rank - len(s)):
            d = int(d)
            if d == out[i] or d == 1:
                continue
            if out[i] == 1:
                out[i] = d
            else:
                raise ShapeError(f"{op}: shapes {' and '.join(str(tuple(s)) for s in shapes)} do not broadcast",
                                 node)
    return tuple(out)
