"""Graph IR: tensors are nodes, built in order by a `GraphBuilder`.

As in ggml, a tensor produced by an op *is* the node; leaves (inputs, weights,
state) have no op. Creation order is a valid execution order, so a graph built
with the builder is acyclic by construction; graphs that arrive from elsewhere
(a serialized core) go through `Graph.validate`, which finds cycles and dangling
references and names the node.

A tensor's memory is owned by its *storage* tensor: itself, or — for view ops
(`reshape`, `permute`, `slice`, ...) and for writes into state (`set_rows`,
`copy_into`) — the tensor it aliases. Strides and offsets are in elements.

A graph may name *dims*: an axis of an input whose size may shrink when the
graph is replayed (`GraphBuilder.dim`, a `Dim` is an int that remembers its
name). Op params given a `Dim` follow it, so a serialized graph (an exported
core) can be rebuilt for a smaller size of that axis (`serialize`), e.g. the
attention window of a language model's KV cache: the declared size is the
largest, each size actually run gets its own plan.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .dtypes import DTYPES, from_numpy, itemsize
from .errors import DTypeError, GraphError, ShapeError

INPUT = "input"
WEIGHT = "weight"
STATE = "state"
CACHE = "cache"
INTERMEDIATE = "intermediate"
ROLES = (INPUT, WEIGHT, STATE, CACHE, INTERMEDIATE)
PERSISTENT = (STATE, CACHE)
MAX_RANK = 4


class Dim(int):
    """An int that is the size of a named dim (`GraphBuilder.dim`): params holding it are
    serialized as a reference to the dim, so a replay at another size substitutes it."""

    dim_name: str

    def __new__(cls, value: int, name: str) -> "Dim":
        obj = super().__new__(cls, value)
        obj.dim_name = name
        return obj

    def __reduce__(self):
        return (Dim, (int(self), self.dim_name))


_STRIDES: dict[tuple, tuple[int, ...]] = {}  # shape -> its strides (asked for every tensor made)
_STRIDES_MAX = 8192


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of `shape` (remembered per shape: a traced graph makes thousands
    of tensors of a few hundred shapes; the dict is bounded and safe to share between threads)."""
    key = shape if type(shape) is tuple else tuple(shape)
    hit = _STRIDES.get(key)
    if hit is not None:
        return hit
    strides, acc = [], 1
    for dim in reversed(key):
        strides.append(acc)
        acc *= max(int(dim), 1)
    out = tuple(reversed(strides))
    if len(_STRIDES) >= _STRIDES_MAX:
        _STRIDES.clear()
    _STRIDES[key] = out
    return out


@dataclass(eq=False)
class Tensor:
    """One value in a graph. Identity is the object (and `id`), not the contents."""

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str = INTERMEDIATE
    op: str | None = None
    srcs: tuple["Tensor", ...] = ()
    params: dict[str, Any] = field(default_factory=dict)
    strides: tuple[int, ...] = ()
    offset: int = 0
    view_of: "Tensor | None" = None
    is_output: bool = False
    data: Any = None  # weights: an ndarray, or a zero-argument callable returning one

    def __post_init__(self) -> None:
        if not self.strides:
            self.strides = contiguous_strides(self.shape)

    @property
    def storage(self) -> "Tensor":
        """The tensor that owns this tensor's memory."""
        t = self
        while t.view_of is not None:
            t = t.view_of
        return t

    @property
    def is_leaf(self) -> bool:
        return self.op is None

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # shapes hold Python ints (integer_shape, OpDef.check); 1 for ()

    @property
    def nbytes(self) -> int:
        """Bytes of a contiguous tensor of this shape (what an allocation needs)."""
        return self.size * itemsize(self.dtype)

    @property
    def is_contiguous(self) -> bool:
        return tuple(self.strides) == contiguous_strides(self.shape)

    @property
    def span_elements(self) -> int:
        """Elements from offset to the last addressed element + 1 (strided extent)."""
        if self.size == 0:
            return 0
        return 1 + sum((d - 1) * s for d, s in zip(self.shape, self.strides))

    def host_data(self) -> np.ndarray:
        """Weight data on the host (loaded lazily if the builder was given a loader)."""
        data = self.data() if callable(self.data) else self.data
        if data is None:
            raise GraphError("tensor has no data", self.name)
        return data

    def __repr__(self) -> str:
        what = self.op or self.role
        return f"Tensor({self.name!r}, {what}, {self.shape}, {self.dtype})"


class Graph:
    """An ordered list of tensors plus named inputs, outputs, weights and state."""

    def __init__(self, tensors: list[Tensor], outputs: Mapping[str, Tensor],
                 dims: Mapping[str, tuple[str, int]] | None = None):
        self.tensors = list(tensors)
        # name -> (input, axis): sizes a replay may shrink (see the module docstring)
        self.dims = dict(dims or {})
        self.outputs = dict(outputs)
        self.inputs = {t.name: t for t in self.tensors if t.role == INPUT}
        self.weights = {t.name: t for t in self.tensors if t.role == WEIGHT}
        self.states = {t.name: t for t in self.tensors if t.role in PERSISTENT}
        self.fusions: list = []  # what flare.core.fusion merged at prepare time (for describe())

    @property
    def nodes(self) -> list[Tensor]:
        """Tensors computed by an op, in execution order."""
        return [t for t in self.tensors if t.op is not None]

    def consumers(self) -> dict[int, list[Tensor]]:
        """tensor id -> nodes that read it."""
        out: dict[int, list[Tensor]] = {t.id: [] for t in self.tensors}
        for node in self.nodes:
            for src in node.srcs:
                out.setdefault(src.id, []).append(node)
        return out

    def validate(self, rules: bool = True) -> None:
        """Check references, order and op rules; raise a GraphError naming the node.

        Builder graphs pass trivially; this guards graphs read back from files.
        `rules=False` skips re-running each op's rule (and the cycle search, which the
        order check implies), for graphs whose nodes the builder checked as it made
        them: what remains catches a source taken from another graph.
        """
        from .ops import OPS  # late: ops import graph for types

        known = {t.id: t for t in self.tensors}
        if len(known) != len(self.tensors):
            raise GraphError("duplicate tensor ids in graph")
        position = {t.id: i for i, t in enumerate(self.tensors)}
        if rules:
            _check_acyclic(self.tensors, known)
        for t in self.tensors:
            if t.op is None:
                if t.role not in (INPUT, WEIGHT, STATE, CACHE):
                    raise GraphError(f"leaf with role {t.role!r} (expected input, weight, state or cache)", t.name)
                continue
            if t.op not in OPS:
                raise GraphError(f"unknown op {t.op!r}", t.name)
            for src in t.srcs:
                if src.id not in known:
                    raise GraphError(f"source {src.name!r} is not in the graph", t.name)
                if position[src.id] > position[t.id]:
                    raise GraphError(f"source {src.name!r} comes after its consumer", t.name)
            if rules:
                OPS[t.op].check(t.name, list(t.srcs), t.params)
        for name, t in self.outputs.items():
            if t.id not in known:
                raise GraphError(f"output {name!r} is not in the graph")

    def __repr__(self) -> str:
        return f"Graph({len(self.nodes)} nodes, inputs={list(self.inputs)}, outputs={list(self.outputs)})"


def _check_acyclic(tensors: Iterable[Tensor], known: Mapping[int, Tensor]) -> None:
    """Kahn's algorithm over src edges; a leftover node sits on a cycle."""
    indegree = {t.id: 0 for t in tensors}
    users: dict[int, list[int]] = {tid: [] for tid in indegree}
    for t in known.values():
        for src in t.srcs:
            if src.id in indegree:
                indegree[t.id] += 1
                users[src.id].append(t.id)
    ready = [tid for tid, deg in indegree.items() if deg == 0]
    seen = 0
    while ready:
        tid = ready.pop()
        seen += 1
        for user in users[tid]:
            indegree[user] -= 1
            if indegree[user] == 0:
                ready.append(user)
    if seen != len(indegree):
        stuck = sorted((known[tid].name for tid, deg in indegree.items() if deg > 0))
        raise GraphError(f"graph has a cycle through {', '.join(stuck[:8])}", stuck[0])


class GraphBuilder:
    """Builds a `Graph` op by op, checking every op's rule as it goes.

    Ops are methods named after the registry (`b.add(x, y)`, `b.matmul(a, w,
    transpose_b=True)`); `b.op(name, *srcs, **params)` is the same by name.
    """

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self._tensors: list[Tensor] = []
        self._outputs: dict[str, Tensor] = {}
        self._names: set[str] = set()
        self._counter = itertools.count()
        self._scopes: list[str] = []
        self._dims: dict[str, tuple[str, int]] = {}

    @contextlib.contextmanager
    def scope(self, prefix: str) -> Iterator[None]:
        """Prefix the names of op nodes made inside (`enc/matmul_3`), including the
        nodes the builder inserts itself, so placement callbacks can route a whole
        stage by name. Leaves (inputs, weights, state) keep their names: weights are
        looked up by them."""
        self._scopes.append(prefix)
        try:
            yield
        finally:
            self._scopes.pop()

    # leaves ------------------------------------------------------------
    def input(self, name: str, shape: Sequence[int], dtype: str = "f32") -> Tensor:
        """A value given to every execute()."""
        return self._leaf(name, shape, dtype, INPUT)

    def state(self, name: str, shape: Sequence[int], dtype: str = "f32") -> Tensor:
        """Persistent per-request state (an LSTM's h/c, a KV cache); zeroed by reset()."""
        return self._leaf(name, shape, dtype, STATE)

    def cache(self, name: str, shape: Sequence[int], dtype: str = "f32") -> Tensor:
        """Persistent device memory written by host callbacks (an expert cache); kept by reset()."""
        return self._leaf(name, shape, dtype, CACHE)

    def weight(
        self,
        name: str,
        data: np.ndarray | Callable[[], np.ndarray] | None = None,
        *,
        shape: Sequence[int] | None = None,
        dtype: str | None = None,
    ) -> Tensor:
        """A constant. Give the array, or shape+dtype and a loader called at upload time.

        Declaring the same weight name again returns the same tensor."""
        if isinstance(data, np.ndarray):
            shape = data.shape if shape is None else shape
            dtype = _dtype_name(data.dtype) if dtype is None else dtype
            if tuple(shape) != data.shape:
                raise ShapeError(f"weight data has shape {data.shape}, declared {tuple(shape)}", name)
        elif shape is None or dtype is None:
            raise GraphError("a weight needs an array, or shape and dtype with a loader", name)
        existing = self._by_name(name)
        if existing is not None and existing.role == WEIGHT:
            if existing.shape != tuple(shape) or existing.dtype != dtype:
                raise ShapeError(f"weight declared again as {tuple(shape)} {dtype}, was {existing.shape} {existing.dtype}", name)
            return existing  # the same weight used twice in one graph
        t = self._leaf(name, shape, dtype, WEIGHT)
        t.data = data
        return t

    def dim(self, name: str, tensor: Tensor, axis: int) -> Dim:
        """Name axis `axis` of input `tensor` as dim `name`: a replay of the serialized graph may
        give that input a smaller size there (at least 1), and every op param set to the
        returned `Dim` takes that size. Only inputs: a weight's or state's shape is fixed."""
        if tensor.role != INPUT or tensor not in self._tensors:
            raise GraphError(f"dim {name!r}: {tensor.name!r} is not an input of this graph", name)
        if not -len(tensor.shape) <= axis < len(tensor.shape):
            raise ShapeError(f"dim {name!r}: axis {axis} is outside {tensor.name!r} {tensor.shape}", name)
        axis %= len(tensor.shape)
        if self._dims.get(name, (tensor.name, axis)) != (tensor.name, axis):
            raise GraphError(f"dim {name!r} is already {self._dims[name]}", name)
        self._dims[name] = (tensor.name, axis)
        return Dim(tensor.shape[axis], name)

    def _by_name(self, name: str) -> Tensor | None:
        if name not in self._names:
            return None
        return next((t for t in self._tensors if t.name == name), None)

    def _leaf(self, name: str, shape: Sequence[int], dtype: str, role: str) -> Tensor:
        if name in self._names:
            raise GraphError("name used twice", name)
        if dtype not in DTYPES:
            raise DTypeError(f"unknown dtype {dtype!r}", name)
        shape = integer_shape(shape, name)
        if not 1 <= len(shape) <= MAX_RANK or min(shape) < 0:
            raise ShapeError(f"shape {shape} must have rank 1..{MAX_RANK} and no negative sizes", name)
        t = Tensor(next(self._ids), name, shape, dtype, role)
        self._names.add(name)
        self._tensors.append(t)
        return t

    # ops ----------------------------------------------------------------
    def op(self, op_name: str, *srcs: Tensor, name: str | None = None, **params: Any) -> Tensor:
        """Append one op node; its rule is checked now, naming the node on failure."""
        opdef = _ops().get(op_name)
        if opdef is None:
            raise GraphError(f"unknown op {op_name!r}", name or op_name)
        name = name or f"{op_name}_{next(self._counter)}"
        if self._scopes:
            name = "/".join(self._scopes) + "/" + name
        if name in self._names:
            raise GraphError("name used twice", name)
        for src in srcs:
            if not isinstance(src, Tensor):
                raise GraphError(f"source of type {type(src).__name__} is not a Tensor", name)
        srcs_list = list(srcs)
        if op_name == "reshape" and not srcs_list[0].is_contiguous:
            srcs_list[0] = self.op("contiguous", srcs_list[0])
        out = opdef.node(name, srcs_list, params, next(self._ids))  # with_defaults + make, remembered
        self._names.add(name)
        self._tensors.append(out)
        return out

    def copy_node(self, node: Tensor, srcs: Sequence[Tensor]) -> Tensor:
        """Append a copy of `node`, an op node of another graph already checked on sources
        of these same shapes, dtypes and strides (a traced graph built again for a plan).

        Why: re-running every op's rule and inference for a graph that was just built
        with the same shapes is most of the cost of building it again; this copies the
        result instead. The sources are checked to match the originals (shape, dtype,
        strides, offset), so the copy is what `op` would have made."""
        name = node.name
        if node.op is None:
            raise GraphError("copy_node copies op nodes; declare leaves with input/weight/state", name)
        if name in self._names:
            raise GraphError("name used twice", name)
        if len(srcs) != len(node.srcs):
            raise GraphError(f"copy of {node.op} with {len(srcs)} sources, the node has {len(node.srcs)}", name)
        for new, old in zip(srcs, node.srcs):
            if (new.shape != old.shape or new.dtype != old.dtype or new.strides != old.strides
                    or new.offset != old.offset):
                raise ShapeError(f"copy of {node.op}: source {new.name!r} is {new.shape} {new.dtype}, "
                                 f"the node was checked on {old.shape} {old.dtype}", name)
        view_of = None
        if node.view_of is not None:
            view_of = next((new for new, old in zip(srcs, node.srcs) if old is node.view_of), None)
            if view_of is None:
                raise GraphError("copy of a view whose storage is not among its sources", name)
        out = Tensor(next(self._ids), name, node.shape, node.dtype, INTERMEDIATE, node.op, tuple(srcs),
                     dict(node.params), node.strides, node.offset, view_of)
        self._names.add(name)
        self._tensors.append(out)
        return out

    def __getattr__(self, op_name: str) -> Callable[..., Tensor]:
        from .ops import OPS

        if op_name.startswith("_") or op_name not in OPS:
            raise AttributeError(op_name)
        return lambda *srcs, **params: self.op(op_name, *srcs, **params)

    def concat_all(self, tensors: Sequence[Tensor], axis: int) -> Tensor:
        """Concatenate several tensors (concat itself takes two)."""
        out = tensors[0]
        for t in tensors[1:]:
            out = self.op("concat", out, t, axis=axis)
        return out

    # outputs ------------------------------------------------------------
    def output(self, name: str, tensor: Tensor) -> Tensor:
        """Mark `tensor` as a graph output returned by execute() under `name`."""
        if name in self._outputs:
            raise GraphError("output name used twice", name)
        if tensor.op is None or tensor.storage.role != INTERMEDIATE:
            tensor = self.op("contiguous", tensor)  # outputs own their memory
        elif tensor.view_of is not None:
            tensor = self.op("contiguous", tensor)
        tensor.is_output = True
        self._outputs[name] = tensor
        return tensor

    def build(self) -> Graph:
        if not self._outputs:
            raise GraphError("graph has no outputs")
        graph = Graph(self._tensors, self._outputs, self._dims)
        return graph


_OPS: dict | None = None
_DTYPE_NAMES: dict[np.dtype, str] = {}  # NumPy dtype -> Flare dtype name (from_numpy walks the table)


def _dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = from_numpy(dtype)  # raises for a dtype Flare lacks
    return name


def _ops() -> dict:
    """The op registry (imported on first use: the ops import this module for its types)."""
    global _OPS
    if _OPS is None:
        from .ops import OPS

        _OPS = OPS
    return _OPS


def integer_shape(shape: Any, where: str) -> tuple[int, ...]:
    """A shape of integers only: 4.5, '4' or True are refused (ShapeError naming `where`), never truncated."""
    if type(shape) is tuple:  # the common case, asked for every leaf a trace declares: plain ints already
        for d in shape:
            if type(d) is not int:
                break
        else:
            return shape
    try:
        dims = list(shape)
        if any(isinstance(d, (bool, np.bool_)) for d in dims):
            raise TypeError("a bool is not a size")
        return tuple(operator.index(d) for d in dims)
    except TypeError:
        raise ShapeError(f"shape {shape!r} must be a sequence of integers", where) from None
