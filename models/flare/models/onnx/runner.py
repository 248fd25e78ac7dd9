"""Run an imported ONNX model on a Flare Session: trace, segment, prepare, execute.

Every call binds the input shapes and walks the ONNX nodes once (`Tracer`):
- a node whose inputs are all constants of the file (or of the bound shapes:
  `Shape`, `Size`) is folded on the host with onnx's reference kernels;
- any other node is lowered onto Flare ops (`lowering.LOWERINGS`) into the
  current *segment*, a Flare graph;
- where a lowering needs the *value* of a computed tensor (a Reshape target, a
  Range limit, NonZero's output size: shapes that depend on data), the
  segment is closed there and executed, and its live values come back to the
  host; the host step runs, and a new segment starts with those values as
  its inputs. The graph is split, not refused.

Prepared graphs: the segments at one place of the trace (the k-th segment,
with the same input names and outputs) form a *family* that shares ONE
PreparedGraph with a plan per input shape, as the runtime does for any graph:
its weights are uploaded once (a leaf's name says what it holds: the file's
value name, or a digest of a computed constant), and a new sentence length,
say, costs a plan, not a graph. A family remembers which structure (a key of
ops, params, shapes, dtypes and weight identities) each input shape had; a
segment whose shapes were seen with another structure (data-dependent control
flow) gets a graph of its own, in a small LRU cache. Every graph of a runner
shares one workspace (segments never run at the same time), so memory is the
largest segment's arena, not the sum. The workspace grows with headroom
(`WORKSPACE_HEADROOM`): each growth makes every plan re-bind, and sentence
lengths grow it a little at a time. A family keeps its `PLANS_KEPT` most
recently used plans (a dropped one is planned again when its shapes return),
and is replaced after `FAMILY_PLANS` shapes, which bounds the computed
constants it accumulates. After a traced call the objects it left alive (its
plans) are frozen out of the garbage collector's full passes (`collector.py`;
`freeze_gc=False` opts out).
A runner is not thread-safe: use one per thread (its Session may be shared;
Flare's PreparedGraph takes turns).
"""
from __future__ import annotations

import hashlib
import marshal
import threading
from collections import OrderedDict
from typing import Any, Mapping, NamedTuple

import numpy as np

from flare.core.errors import InputError
from flare.core.graph import INPUT, WEIGHT, GraphBuilder, Tensor

from .collector import FreezePolicy
from .errors import OnnxError, UnsupportedOpError
from .loader import DEFAULT_DOMAINS, OnnxModel
from .replay import Checkpoint, NeedsTrace, Recording, Recordings, Resume
from .tails import Tails
from .values import BOOL, MAX_RANK, Val, flare_dtype, flare_shape, from_flare_array, is_wide, to_flare_array

ENTRY = "main"
CACHE_SIZE = 16      # graphs of segments outside their family (data-dependent structure)
# folds of small computed constants remembered by value: inputs up to FOLD_MEMO_BYTES, outputs up to
# FOLD_MEMO_OUT_BYTES (a ConstantOfShape of a whole audio length is cheap to fold again, and kept it
# was ~6 MB a new Piper sentence), cleared when it holds FOLD_MEMO entries or FOLD_MEMO_TOTAL bytes
FOLD_MEMO, FOLD_MEMO_BYTES, FOLD_MEMO_OUT_BYTES, FOLD_MEMO_TOTAL = 65536, 4096, 16384, 16 << 20
WORKSPACE_HEADROOM = 1.5  # GraphWorkspace headroom of a runner's shared arena
FAMILY_PLANS = 64    # input shapes a family graph serves before it is replaced (its computed constants)
CHECKPOINT_BYTES = 1 << 20  # computed constants a checkpoint may keep (recordings are kept by the hundred)
PLANS_KEPT = 24      # plans a family graph keeps, least recently used dropped (a dropped one is re-planned)
# ops never folded at import time even when their inputs are constant (a fresh draw each run)
# how a node runs (OnnxRunner.node_facts): folded when its inputs are all constants, else lowered; or a host step
FOLDABLE, LOWERED, HOST = 0, 1, 2
NO_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


def static_values(model: OnnxModel) -> set[str]:
    """Names whose value is known without running the model once input shapes are bound."""
    known = set(model.initializers) | {""}
    for node in model.graph.node:
        if node.op_type in NO_FOLD:
            continue
        if node.op_type in ("Shape", "Size") or node.op_type == "Constant" or all(i in known for i in node.input):
            known.update(node.output)
    return known


def check_supported(model: OnnxModel) -> None:
    """Refuse, in one line naming every op and a node of it, what can be neither lowered nor folded."""
    from .lowering import HOST_STEPS, LOWERINGS

    static = static_values(model)
    missing: dict[str, str] = {}
    for i, node in enumerate(model.graph.node):
        if all(o in static for o in node.output if o):
            continue
        key = node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"
        if node.domain not in DEFAULT_DOMAINS or (node.op_type not in LOWERINGS and node.op_type not in HOST_STEPS):
            missing.setdefault(key, node.name or f"#{i}")
    if missing:
        listed = ", ".join(f"{op} (node {name!r})" for op, name in sorted(missing.items()))
        raise UnsupportedOpError(f"{model.path}: unsupported ONNX op(s): {listed}")


def expand(model: OnnxModel) -> OnnxModel:
    """The model with function ops the lowering table lacks inlined (see functions.py)."""
    from .functions import expand_functions
    from .lowering import HOST_STEPS, LOWERINGS

    proto = expand_functions(model.proto, model.opset, set(LOWERINGS) | set(HOST_STEPS))
    if proto is model.proto:
        return model
    return OnnxModel(proto, model.path, model.opset, model.initializers)


class FeedShape(NamedTuple):
    """What a slim segment keeps of a feed: its shape and dtype."""

    shape: tuple
    dtype: np.dtype


class Segment:
    """One traced Flare graph: its tensors in order, outputs, and the feeds of its inputs."""

    def __init__(self, tensors: list[Tensor], outputs: dict[str, Tensor], feeds: dict[str, np.ndarray],
                 digests: dict[str, str]):
        self.tensors = tensors
        self.outputs = outputs
        self.feeds = feeds
        self.key = _structure_key(tensors, outputs, digests)

    def slim(self) -> "Segment":
        """The same segment without its tensors and arrays (what a recording keeps): it runs
        only where a plan for its shapes exists (`OnnxRunner.execute_segment` raises
        `NeedsTrace` otherwise). Why: a recording holding every traced tensor kept ~10k Python
        objects a sentence alive, and the collector's full passes over them cost more than
        the rare retrace of a segment whose plan was evicted."""
        seg = Segment.__new__(Segment)
        seg.tensors, seg.key = None, self.key
        seg.outputs = dict.fromkeys(self.outputs)
        seg.feeds = {n: FeedShape(tuple(a.shape), a.dtype) for n, a in self.feeds.items()}
        return seg

    def with_feeds(self, feeds: dict[str, np.ndarray]) -> "Segment":
        """The same segment (structure, key) on other input arrays of the same shapes."""
        seg = Segment.__new__(Segment)
        seg.tensors, seg.outputs, seg.key, seg.feeds = self.tensors, self.outputs, self.key, feeds
        return seg

    def builder(self):
        """The entry builder Flare prepares: replays the traced tensors exactly.

        The op nodes are copied (`GraphBuilder.copy_node`), not made again: the trace
        checked them on these very shapes, and re-running every op's rule was most of
        the cost of a new plan."""
        tensors, outputs = self.tensors, self.outputs

        def build(b: GraphBuilder, shapes: Mapping[str, Any]) -> None:
            made: dict[int, Tensor] = {}
            for t in tensors:
                if t.role == INPUT:
                    made[t.id] = b.input(t.name, shapes[t.name], t.dtype)
                elif t.role == WEIGHT:
                    made[t.id] = b.weight(t.name, t.data)
                else:
                    made[t.id] = b.copy_node(t, [made[s.id] for s in t.srcs])
            for name, t in outputs.items():
                b.output(name, made[t.id])
        return build


def _same_shape_elementwise(op_type: str, ins: list) -> bool:
    """An elementwise op whose operands are one wide shape, or single elements: safe on merged shapes."""
    from .lowering import ELEMENTWISE

    if op_type not in ELEMENTWISE:
        return False
    shapes = {v.shape for v in ins if v is not None and int(np.prod(v.shape, dtype=np.int64)) != 1}
    return len(shapes) <= 1 and all(v is None or len(v.shape) == max(len(s) for s in shapes) or
                                    int(np.prod(v.shape, dtype=np.int64)) == 1 for v in ins)


def _names_read(node: Any) -> set[str]:
    """Every value a node reads, including those its subgraphs (If branches) read from outside."""
    names = {n for n in node.input if n}
    for a in node.attribute:
        for g in list(a.g and [a.g] or []) + list(a.graphs):
            for inner in g.node:
                names |= _names_read(inner)
    return names


def _small_values_key(node_key: tuple, ins: list) -> tuple | None:
    """The node and its inputs' values, when they are all small (shape arithmetic: the folds that
    depend on the input shapes, the same again for a repeated shape), else None."""
    parts = []
    total = 0
    for v in ins:
        if v is None:
            parts.append(None)
            continue
        a = v.const
        if not isinstance(a, np.ndarray) or a.dtype.hasobject:
            return None
        total += a.nbytes
        if total > FOLD_MEMO_BYTES:
            return None
        parts.append((a.dtype.str, a.shape, a.tobytes()))
    return node_key, tuple(parts)


def _reachable(tensors: list[Tensor], outputs: Any) -> list[Tensor]:
    """The segment's inputs and the tensors its outputs read, in order: what a lowering made
    and a later one bypassed (a zero Pad folded into its Conv's padding) is not run."""
    keep = {t.id for t in outputs}
    for t in reversed(tensors):
        if t.id in keep:
            keep.update(s.id for s in t.srcs)
    if len(keep) == len(tensors):
        return list(tensors)
    return [t for t in tensors if t.id in keep or t.role == INPUT]


def _structure_key(tensors: list[Tensor], outputs: Mapping[str, Tensor], digests: Mapping[str, str]) -> str:
    # one serialization of the whole list (not one hash update per tensor). Parameters in their dict's
    # order (the op's defaults, then the lowering's keywords): the same lowering gives the same order,
    # and another order would only give an equal structure a second key (a plan of its own), never a
    # wrong plan
    index = {t.id: i for i, t in enumerate(tensors)}
    get = digests.get
    rows = [(t.role, t.name, t.shape, t.dtype, t.op, [index[s.id] for s in t.srcs], t.params, get(t.name))
            for t in tensors]
    h = hashlib.blake2b(_serialized(rows), digest_size=20)
    h.update(repr(sorted((n, index[t.id]) for n, t in outputs.items())).encode())
    return h.hexdigest()


_SCALARS = frozenset((int, float, str, bool, type(None)))


def _plain(v: Any) -> bool:
    """Whether v is built of exact ints, floats, strs, bools, None, tuples, lists and str-keyed
    dicts only: what marshal writes by value. (It writes any object with a buffer, a NumPy scalar
    or array, as its bare bytes: np.int64(1) would then equal the bytes b"\\x01\\0...", an int32
    array a float32 one; those keep the repr form.)"""
    t = type(v)
    if t in _SCALARS:
        return True
    if t is tuple or t is list:
        return all(type(x) in _SCALARS or _plain(x) for x in v)
    if t is dict:
        return all(type(k) is str and (type(x) in _SCALARS or _plain(x)) for k, x in v.items())
    return False


def _serialized(rows: list) -> bytes:
    """`marshal` format 2 of the rows (several times faster than their repr on a Piper tail of
    ~650 tensors), else their repr where a parameter is not plain (`_plain`: a Dim, a NumPy
    value). Why either is a sound key: both are functions of the values alone (format 2 writes no
    back-references, so object identity and sharing do not show), and marshal's bytes of plain
    values load back to those values, so equal bytes are equal rows. The leading byte keeps the
    two forms apart; a structure always takes the same form. The other fields of a row are
    strs, ints, None and tuples of ints by construction (Tensor)."""
    if all(_plain(r[6]) for r in rows):
        return b"m" + marshal.dumps(rows, 2)
    return b"r" + repr(rows).encode()


def array_digest(arr: np.ndarray) -> str:
    """A content name for a computed constant (32 hex digits). SHA-256 over the array's own buffer:
    twice blake2b's speed where the CPU has SHA instructions, and no copy of the bytes (a new
    Piper sentence digests ~65 computed constants, ~10 MB)."""
    a = np.ascontiguousarray(arr)
    h = hashlib.sha256(repr((a.shape, a.dtype.str)).encode())
    h.update(a.reshape(-1).view(np.uint8).data if a.size else b"")
    return h.hexdigest()[:32]


def _where(path: Any, node: Any, label: str | int, op_type: str) -> str:
    """The start of a stepped node's error message: the file, the node's label (`label`, or for
    a position the node's name, else its position and op type) and its op type."""
    text = (node.name or f"#{label} ({node.op_type})") if type(label) is int else label
    return f"{path}: node {text!r} ({op_type})"


class _Family:
    """The PreparedGraph of the segments at one place of the trace, a plan per input shape.

    `current` is the segment being executed: the graph's builder replays it whenever the
    runtime needs a plan for its input shapes. `structure` maps input shapes to the one
    structure key allowed for them (the runtime picks plans by input shapes alone)."""

    def __init__(self) -> None:
        self.pg: Any = None
        self.current: Segment | None = None
        self.structure: dict[tuple, str] = {}

    def build(self, b: GraphBuilder, shapes: Mapping[str, Any]) -> None:
        seg = self.current
        want = {n: tuple(a.shape) for n, a in seg.feeds.items()}
        if {n: tuple(shapes[n]) for n in want} != want:
            raise OnnxError(f"segment plan asked for shapes {dict(shapes)}, the segment has {want}")
        seg.builder()(b, shapes)


def _same_feeds(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].shape == b[n].shape and a[n].dtype == b[n].dtype and np.array_equal(a[n], b[n]) for n in a)


def _adopt_draw(drawn: list | None, outs: list) -> None:
    """Overwrite a random host step's fresh outputs with the draw a failed replay made of the same
    node (`runner.reuse_draws`), where shapes and dtypes agree: one draw per node per call, so the
    segments the replay ran on it are reused by the trace (`runner.reuse`) instead of run again."""
    if drawn is None or len(drawn) != len(outs):
        return
    pairs = [(o, d) for o, d in zip(outs, drawn) if o is not None and d is not None]
    if all(isinstance(o.const, np.ndarray) and o.const.flags.writeable and np.shape(d) == o.const.shape
           and np.asarray(d).dtype == o.const.dtype for o, d in pairs):
        for o, d in pairs:
            np.copyto(o.const, d)


def _shape_key(seg: Segment) -> tuple:
    return tuple(sorted((n, tuple(a.shape), a.dtype.str) for n, a in seg.feeds.items()))


class OnnxRunner:
    """An imported model on a Session: `run(inputs) -> outputs` (ONNX names, shapes, dtypes)."""

    def __init__(self, model: OnnxModel, session: Any, *, cache_size: int = CACHE_SIZE, freeze_gc: bool = True):
        model = expand(model)
        check_supported(model)
        self.model = model
        self.session = session
        self.cache_size = cache_size
        self._plans: OrderedDict[str, Any] = OrderedDict()      # structure key -> graph (outside families)
        self._families: dict[tuple, _Family] = {}
        self._digests: dict[int, tuple[np.ndarray, str]] = {}   # id -> (array, digest) of derived file constants
        # headroom: sentence lengths grow the arena a little at a time, and each growth re-binds every plan
        self.workspace = session.workspace(f"onnx:{model.path}:workspace", headroom=WORKSPACE_HEADROOM)
        self._folded: dict[tuple, list[Val]] = {}  # (op, inputs, outputs) -> outputs, for nodes of file constants only
        self._folded_by_value: dict[tuple, list[Val]] = {}  # (node, small input values) -> outputs
        self._folded_by_value_bytes = 0
        self._fold_ops: dict[tuple, Any] = {}  # (node bytes, opset) -> onnx.reference kernel (lowering.base.fold)
        self._walk: tuple[list[Any], dict[str, int]] | None = None
        self._labels: list[str] | None = None
        self._walk_facts: list[tuple] | None = None
        self._flare_arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(file value) -> (it, its Flare array)
        self._attrs: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._facts: dict[int, tuple[Any, tuple]] = {}  # id(node) -> (node, Tracer.step's facts of it)
        self._live: dict[int, tuple[str, ...]] = {}  # node position -> what a checkpoint there keeps (live_at)
        self._node_ids = {id(n) for n in self.walk_plan()[0]}
        # arrays lowerings derive from file constants (a re-laid-out kernel), made once per runner
        self.derived: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.stats = {"segments_run": 0, "prepared": 0, "host_steps": 0, "folded": 0, "replayed": 0}
        self.last_segments: list[dict[str, Any]] = []
        self.recordings = Recordings()  # traces replayed for later calls of the same input shapes (replay.py)
        # segments a failed replay ran, for the trace that follows: (key, ordinal) -> (feeds, results)
        self.reuse: dict[tuple, tuple] = {}
        # random draws a failed replay made, for the trace that follows: id(node) -> output arrays
        self.reuse_draws: dict[int, list] = {}
        self.resume: Resume | None = None  # where a failed replay lets the trace start (replay.py)
        self.tails = Tails()  # tails after a checkpoint re-derived for a new length read there (tails.py)
        # a traced call's plans are frozen out of the collector's full passes (collector.py)
        self.collector = FreezePolicy(freeze_gc)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            inputs = self._check_inputs(inputs)
            key = Recordings.key(inputs)
            out = self.recordings.replay(self, key, inputs)
            if out is not None:
                return out
            rec = Recording()
            host_steps = self.stats["host_steps"]
            resume, self.resume = self.resume, None
            if resume is not None:
                done = self.tails.run(self, key, resume)
                if done is not None:
                    self.reuse, self.reuse_draws = {}, {}
                    out, rec = done
                    self.recordings.add(key, rec)
                    self.collector.after_trace()  # a new plan was made: freeze it like a trace's
                    return out
            try:
                out = Tracer(self, inputs, rec, resume).run()
            finally:
                self.reuse, self.reuse_draws = {}, {}
            rec.host_steps = self.stats["host_steps"] - host_steps + (resume.checkpoint.host_steps if resume else 0)
            self.tails.learn(key, rec)  # before add: a recording keeps slim segments
            self.recordings.add(key, rec)
            self.collector.after_trace()
            return out

    def _check_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        info = self.model.input_info()
        unknown = sorted(set(inputs) - set(info) - set(self.model.initializers))
        if unknown:
            raise InputError(f"{self.model.path}: no input named {unknown[0]!r} (inputs: {', '.join(info)})")
        missing = [n for n in info if n not in inputs]
        if missing:
            raise InputError(f"{self.model.path}: input {missing[0]!r} not given")
        out = {}
        for name, value in inputs.items():
            arr = np.asarray(value)
            dims, dtype = info.get(name, (None, None))
            if dtype is not None and arr.dtype != dtype:
                raise InputError(f"input {name!r}: dtype {arr.dtype}, the model declares {dtype}")
            if dims is not None and len(dims) != arr.ndim:
                raise InputError(f"input {name!r}: rank {arr.ndim}, the model declares {len(dims)} ({dims})")
            if dims is not None:
                for axis, (want, got) in enumerate(zip(dims, arr.shape)):
                    if isinstance(want, int) and want > 0 and want != got:
                        raise InputError(f"input {name!r}: axis {axis} has size {got}, the model declares {want}")
            out[name] = arr
        return out

    def execute_segment(self, seg: Segment, ordinal: int = 0) -> dict[str, np.ndarray]:
        """Run the segment on its family's graph (a new plan for new input shapes), or, when
        its shapes were seen there with another structure, on a graph of its own."""
        self.stats["segments_run"] += 1
        if self.reuse:
            done = self.reuse.pop((seg.key, ordinal), None)
            if done is not None and _same_feeds(done[0], seg.feeds):
                self.stats["reused"] = self.stats.get("reused", 0) + 1
                return done[1]   # the same structure on the same arrays: the same outputs
        where = (ordinal, tuple(sorted(seg.feeds)), tuple(seg.outputs))
        shapes = _shape_key(seg)
        fam = self._families.get(where)
        if seg.tensors is None and not self._can_run_slim(seg, fam, shapes):
            raise NeedsTrace(f"no plan left for segment #{ordinal} at these shapes")
        if fam is not None and fam.structure.get(shapes, seg.key) != seg.key:
            return self._execute_alone(seg)
        if fam is not None and shapes not in fam.structure and len(fam.structure) >= FAMILY_PLANS:
            del self._families[where]
            fam.pg.release()
            fam = None
        fam = fam or self._new_family(where, seg)
        if shapes not in fam.structure:
            self.stats["prepared"] += 1
            fam.structure[shapes] = seg.key
        fam.current = seg
        try:
            return fam.pg.execute(ENTRY, **seg.feeds)
        finally:
            fam.current = None  # the segment's arrays are not kept alive by the family

    def _can_run_slim(self, seg: Segment, fam: "_Family | None", shapes: tuple) -> bool:
        """A segment without tensors runs only on a plan that exists (nothing to build from)."""
        if fam is not None and fam.structure.get(shapes, seg.key) != seg.key:
            pg = self._plans.get(seg.key)
        elif fam is not None and shapes in fam.structure and len(fam.structure) <= FAMILY_PLANS:
            pg = fam.pg
        else:
            return False
        return pg is not None and pg.plans.get(ENTRY, {n: tuple(a.shape) for n, a in seg.feeds.items()}) is not None

    def _new_family(self, where: tuple, seg: Segment) -> _Family:
        fam = _Family()
        fam.current = seg
        shapes = {ENTRY: {n: a.shape for n, a in seg.feeds.items()}}
        fam.pg = self.session.prepare({ENTRY: fam.build}, shapes, workspace=self.workspace,
                                      name=f"onnx:{self.model.path}#{where[0]}")
        fam.pg.max_plans = PLANS_KEPT
        self._families[where] = fam
        return fam

    def _execute_alone(self, seg: Segment) -> dict[str, np.ndarray]:
        pg = self._plans.get(seg.key)
        if pg is None:
            shapes = {ENTRY: {n: a.shape for n, a in seg.feeds.items()}}
            pg = self.session.prepare({ENTRY: seg.builder()}, shapes, workspace=self.workspace,
                                      name=f"onnx:{self.model.path}")
            self.stats["prepared"] += 1
            self._plans[seg.key] = pg
            while len(self._plans) > self.cache_size:
                _, old = self._plans.popitem(last=False)
                old.release()
        else:
            self._plans.move_to_end(seg.key)
        return pg.execute(ENTRY, **seg.feeds)

    def digest(self, value: np.ndarray, arr: np.ndarray, fixed: bool) -> str:
        """array_digest(arr) of a constant's Flare array; remembered by the constant's object for
        values derived from the file (folded once per runner: the same object every call)."""
        if not fixed:
            return array_digest(arr)
        hit = self._digests.get(id(value))
        if hit is None or hit[0] is not value:
            hit = self._digests[id(value)] = (value, array_digest(arr))
        return hit[1]

    def flare_array(self, value: np.ndarray, name: str) -> np.ndarray:
        """to_flare_array of a value derived from the file (the same object every call: an
        initializer, or a fold of them), made once per runner (a new segment re-reads ~40)."""
        hit = self._flare_arrays.get(id(value))
        if hit is None or hit[0] is not value:
            hit = self._flare_arrays[id(value)] = (value, to_flare_array(value, f"value {name!r}"))
        return hit[1]

    def attributes(self, node: Any, read: Any) -> dict[str, Any]:
        """A node's attributes as Python values (`read(node)`), once per node of the model: lowerings
        only read them. Nodes of If branches (protos made per trace) are read every time."""
        key = id(node)
        hit = self._attrs.get(key)
        if hit is None or hit[0] is not node:
            hit = (node, read(node))
            if key in self._node_ids:
                self._attrs[key] = hit
        return hit[1]

    def node_facts(self, node: Any, lw: Any) -> tuple:
        """What `Tracer.step` reads of a node that no call changes: its op type, input and output
        names, how it runs (FOLDABLE when its inputs are constants, HOST, or LOWERED only), whether
        it takes values of rank > 4, its fold key, how many outputs it names and its lowering (None:
        an op or domain the table lacks). Once per node of the model (a new Piper
        sentence steps ~1,300 nodes, each reading these from the proto several times); nodes of
        If branches (protos made per trace) are read every time."""
        key = id(node)
        hit = self._facts.get(key)
        if hit is not None and hit[0] is node:
            return hit[1]
        op_type = node.op_type
        inputs, outputs = tuple(node.input), tuple(node.output)
        if op_type in lw.HOST_STEPS:
            how = HOST
        elif op_type in NO_FOLD or op_type == "If":
            how = LOWERED
        else:
            how = FOLDABLE
        lowering = lw.LOWERINGS.get(op_type) if node.domain in DEFAULT_DOMAINS else None  # None: unsupported
        facts = (op_type, inputs, outputs, how, op_type in lw.WIDE_OK, (op_type, inputs, outputs),
                 sum(1 for o in outputs if o), lowering)
        if key in self._node_ids:
            self._facts[key] = (node, facts)
        return facts

    def walk_facts(self, lw: Any) -> list[tuple]:
        """`node_facts` of each walked node, by position: once per runner."""
        if self._walk_facts is None:
            self._walk_facts = [self.node_facts(node, lw) for node in self.walk_plan()[0]]
        return self._walk_facts

    def node_labels(self) -> list[str]:
        """Each walked node's prefix of its Flare op names (its name, else its op type): once per runner."""
        if self._labels is None:
            self._labels = [node.name or node.op_type for node in self.walk_plan()[0]]
        return self._labels

    def live_at(self, pos: int) -> tuple[str, ...]:
        """The values a checkpoint at node `pos` keeps: the call's inputs and the outputs of the
        nodes before it that a node at `pos` or later reads (not the file's initializers), in
        walk order. Once per position (a checkpoint walked the whole environment, ~2,000 values
        on Piper, at each of a sentence's ~11 segment closes). Values of If branches are not
        among them: a resumed trace steps the If again."""
        hit = self._live.get(pos)
        if hit is None:
            nodes, last_use = self.walk_plan()
            init = self.model.initializers
            names = list(self.model.input_names) + [o for node in nodes[:pos] for o in node.output if o]
            hit = self._live[pos] = tuple(n for n in dict.fromkeys(names)
                                          if n not in init and last_use.get(n, -1) >= pos)
        return hit

    def walk_plan(self) -> tuple[list[Any], dict[str, int]]:
        """The nodes in order and the last node reading each value (the model's outputs: past the
        end): the same for every call, so computed once."""
        if self._walk is None:
            nodes = list(self.model.graph.node)
            last_use: dict[str, int] = {}
            for i, node in enumerate(nodes):
                for name in _names_read(node):
                    last_use[name] = i
            for name in self.model.output_names:
                last_use[name] = len(nodes) + 1
            self._walk = (nodes, last_use)
        return self._walk

    def prepared_graphs(self) -> list[Any]:
        return [f.pg for f in self._families.values()] + list(self._plans.values())

    def describe(self) -> dict[str, Any]:
        """PreparedGraph.describe() of every cached segment, merged (entries `segment<i>`,
        persistent bytes summed per device; workspace bytes are the one workspace all of them
        share, counted once)."""
        out: dict[str, Any] = {"name": f"onnx:{self.model.path}", "entries": {}, "persistent_bytes": {},
                               "workspace_bytes": {}}
        for i, pg in enumerate(self.prepared_graphs()):
            info = pg.describe()
            for entry in info["entries"].values():
                out["entries"][f"segment{i}"] = entry
            for dev, n in info.get("persistent_bytes", {}).items():
                out["persistent_bytes"][dev] = out["persistent_bytes"].get(dev, 0) + n
            for dev in info.get("workspace_bytes", {}):
                out["workspace_bytes"][dev] = self.workspace.nbytes(dev)
        return out

    @property
    def pg(self) -> "OnnxRunner":
        """What the bench harness reads plans from (`.pg.describe()`): the runner itself."""
        return self

    def release(self) -> None:
        """Release every prepared graph, then free the arenas of the workspace they shared
        (idempotent). The runner stays usable: a later call prepares again."""
        with self._lock:
            self.recordings = Recordings()
            self.tails = Tails()
            while self._families:
                _, fam = self._families.popitem()
                fam.pg.release()
            while self._plans:
                _, pg = self._plans.popitem()
                pg.release()
            self.workspace.free()


class Tracer:
    """One walk over the nodes for one call; see the module docstring."""

    def __init__(self, runner: OnnxRunner, inputs: Mapping[str, np.ndarray], rec: Recording | None = None,
                 resume: Resume | None = None):
        from . import lowering

        self.rec = rec or Recording()
        self.runner = runner
        self.model = runner.model
        self.opset = runner.model.opset
        self.lowering = lowering
        self.env: dict[str, Val] = {}
        self.nodes, last_use = runner.walk_plan()
        self.labels = runner.node_labels()
        self.last_use: dict[str, int] = dict(last_use)
        for name, arr in self.model.initializers.items():
            self.env[name] = Val(name, tuple(arr.shape), arr.dtype, const=arr, fixed=True)
        for name, arr in inputs.items():
            self.env[name] = Val(name, tuple(arr.shape), arr.dtype, const=arr, runtime=True)
            self.rec.mark(arr, ("input", name))
        self.position = -1
        self.start = 0              # the first node walked (a resumed trace starts later)
        self._depth = 0             # inside If branches (run_branch): no checkpoints there
        self._count = self._anon = self._count_at_node = self._anon_at_node = 0
        self._host_steps0 = runner.stats["host_steps"]
        self._prefix_summaries: list = []
        self._new_segment()
        if resume is not None:
            self._restore(resume)

    def _restore(self, resume: Resume) -> None:
        """Continue a replay that gave up: the live values of its checkpoint, bound to this
        call's arrays, and the walk from the checkpoint's node."""
        cp = resume.checkpoint
        self.rec.resumed(resume)
        for name, shape, dtype, src, fixed, runtime in cp.values:
            arr = resume.value(src)
            self.env[name] = Val(name, shape, dtype, const=arr, runtime=runtime, fixed=fixed)
            if runtime:
                self.rec.mark(arr, src)
        self.start, self.ordinal, self._count, self._anon = cp.position, cp.ordinal, cp.count, cp.anon
        self._host_steps0 -= cp.host_steps
        self._prefix_summaries = list(resume.summaries)
        self.runner.stats["resumed"] = self.runner.stats.get("resumed", 0) + 1

    def _checkpoint(self) -> Checkpoint | None:
        """The state a resumed trace needs to walk on from the node being stepped, or None
        where a live value has no known source (or none yet)."""
        pos = self.position
        if self._depth or not 0 <= pos < len(self.nodes) or not self.rec.valid:
            return None
        env = self.env
        values = []
        held = 0  # bytes of computed constants the checkpoint would keep alive (the file's are shared)
        for name in self.runner.live_at(pos):
            v = env.get(name)
            if v is None:
                continue
            src = self.rec.known_source(v)
            if src is None:
                return None
            if src[0] == "const" and not v.fixed:
                held += getattr(src[1], "nbytes", 0)
                if held > CHECKPOINT_BYTES:
                    return None
            values.append((name, v.shape, v.dtype, src, v.fixed, v.runtime))
        return Checkpoint(pos, self.ordinal + 1, self._count_at_node, self._anon_at_node,
                          self.runner.stats["host_steps"] - self._host_steps0, tuple(values))

    # -- segments -------------------------------------------------------------
    def _new_segment(self) -> None:
        self.ordinal = getattr(self, "ordinal", -1) + 1
        self.b = GraphBuilder()
        self.feeds: dict[str, np.ndarray] = {}
        self.digests: dict[str, str] = {}
        self.leaves: dict[str, Tensor] = {}
        self.live_tensors: dict[str, Val] = {}

    def _close_segment(self, extra: tuple[Val, ...] = ()) -> None:
        """Run the current segment; its live values (and `extra`) become host arrays."""
        wanted = {v.name: v for v in extra if v.tensor is not None}
        for name, v in self.live_tensors.items():
            if v.tensor is not None and self.last_use.get(name, -1) >= self.position:
                wanted[name] = v
        if wanted:
            outputs = {}
            for i, (name, v) in enumerate(wanted.items()):
                outputs[f"out{i}"] = self.b.output(f"out{i}", v.tensor)
            seg = Segment(_reachable(self.b._tensors, outputs.values()), outputs, dict(self.feeds),
                          dict(self.digests))
            summary = {"nodes": len([t for t in seg.tensors if t.op]), "inputs": len(seg.feeds),
                       "outputs": len(outputs)}
            index = self.rec.segment(seg, self.ordinal, summary, [])
            results = self.runner.execute_segment(seg, self.ordinal)
            self.runner.last_segments.append(summary)
            for i, (name, v) in enumerate(wanted.items()):
                v.const = from_flare_array(results[f"out{i}"], v.shape, v.dtype)
                v.tensor = None
                v.runtime = True
            self.rec.closed(index, [(f"out{i}", v) for i, v in enumerate(wanted.values())])
            cp = self._checkpoint()
            if cp is not None:
                self.rec.checkpoint(cp)
        for v in self.live_tensors.values():
            v.tensor = None  # dead values of the closed segment are gone
        self._new_segment()

    # -- what lowerings call ---------------------------------------------------
    def t(self, v: Val) -> Tensor:
        """v as a tensor of the current segment (a weight or an input leaf for constants)."""
        if v.tensor is not None:
            return v.tensor
        if v.const is None:
            raise OnnxError(f"value {v.name!r} was used after its segment closed")
        anonymous = not v.name
        if anonymous:
            self._anon += 1
            v.name = f"const{self._anon}@{self.position}"
        leaf = self.leaves.get(v.name)
        if leaf is None:
            arr = self.runner.flare_array(v.const, v.name) if v.fixed else to_flare_array(v.const, f"value {v.name!r}")
            if v.runtime:
                leaf_name = f"v:{v.name}"
                leaf = self.b.input(leaf_name, arr.shape, flare_dtype(arr.dtype if v.dtype != BOOL else v.dtype, v.name))
                self.feeds[leaf_name] = arr
                self.rec.feed(leaf_name, v)
            elif v.fixed and not anonymous:  # a value of the file (by its unique name): the same every call
                leaf_name = f"v:{v.name}"
                leaf = self.leaves.get(leaf_name) or self.b.weight(leaf_name, arr)
                self.digests[leaf_name] = "file"
            else:  # computed (from shapes, or re-laid-out): named by its content, so a family graph's
                digest = self.runner.digest(v.const, arr, v.fixed)  # weights by name stay right
                leaf_name = f"c:{digest}"
                leaf = self.leaves.get(leaf_name) or self.b.weight(leaf_name, arr)
                self.digests[leaf_name] = digest
            self.leaves[v.name] = self.leaves[leaf_name] = leaf
        return leaf

    def c(self, v: Val) -> np.ndarray:
        """v's value now: a constant, or the segment is closed and run to compute it (a host step)."""
        if v.const is None:
            self.runner.stats["host_steps"] += 1
            self._close_segment((v,))
        self.rec.observe(v)
        return v.const

    def op(self, op: str, *srcs: Tensor, **params: Any) -> Tensor:
        return self.b.op(op, *srcs, name=self._name(op), **params)

    def _name(self, op: str) -> str:
        self._count += 1
        pos = self.position
        label = self.labels[pos] if 0 <= pos < len(self.labels) else "io"
        return f"{label}/{op}_{self._count}"

    def val(self, tensor: Tensor, shape: tuple[int, ...], dtype: np.dtype, name: str = "") -> Val:
        """Wrap a Flare tensor as the ONNX value of `shape`/`dtype` (reshaping a scalar's (1,) etc.)."""
        shape = tuple(map(int, shape))
        if tuple(tensor.shape) != flare_shape(shape):
            tensor = self.op("reshape", tensor, shape=list(flare_shape(shape)))
        v = Val(name, shape, np.dtype(dtype), tensor=tensor)
        return v

    # -- the walk ----------------------------------------------------------------
    def run(self) -> dict[str, np.ndarray]:
        self.runner.last_segments = self._prefix_summaries
        step, nodes, facts = self.step, self.nodes, self.runner.walk_facts(self.lowering)
        for i in range(self.start, len(nodes)):
            self.position = i
            self._count_at_node, self._anon_at_node = self._count, self._anon
            step(nodes[i], i, facts[i])  # the node's label is made only for an error message
        self.position = len(self.nodes)
        final = [self.env[n] for n in self.model.output_names]
        if any(v.tensor is not None for v in final):
            self.position = len(self.nodes) + 1  # nothing is live after the end except the outputs
            self._close_segment(tuple(v for v in final))
        self.rec.finish(self.env, list(self.model.output_names))
        return {n: np.asarray(self.env[n].const).reshape(self.env[n].shape).astype(self.env[n].dtype, copy=False)
                for n in self.model.output_names}

    def step(self, node: Any, label: str | int, facts: tuple | None = None) -> None:
        """Fold, lower or host-run one node and bind its outputs (also for the nodes of an If branch).
        `label` names the node in errors; an int is its position in the walk (the name is made only
        when an error needs it: a sentence steps ~1,600 nodes). `facts`: `runner.node_facts(node)`,
        which the walk has by position."""
        lw = self.lowering
        op_type, inputs, outputs, how, wide_ok, fold_key, named, fn = facts or self.runner.node_facts(node, lw)
        env = self.env
        ins = [env[n] if n else None for n in inputs]
        folds = how == FOLDABLE
        for v in ins:  # one pass over the inputs: a wide computed value, and whether all are constants
            if v is None:
                continue
            if v.const is None:
                folds = False
                if not wide_ok and len(v.shape) > MAX_RANK:
                    wide_ok = _same_shape_elementwise(op_type, ins)
                    if not wide_ok:
                        wide = next(v for v in ins if v is not None and is_wide(v.shape))
                        raise OnnxError(f"{_where(self.model.path, node, label, op_type)}: input {wide.name!r} has "
                                        f"rank {len(wide.shape)}; Flare tensors have rank <= 4 and only "
                                        f"reshape-like ops and Expand take wider values")
            elif v.runtime:
                folds = False
        try:
            if folds:
                outs = self._fold_cached(node, ins, lw.fold, fold_key)
                self.runner.stats["folded"] += 1
            elif how == HOST:
                host = lw.HOST_STEPS[op_type]
                outs = host(self, node, ins)
                if self.runner.reuse_draws:
                    _adopt_draw(self.runner.reuse_draws.pop(id(node), None), outs)
                self.rec.host_step(node, host, ins, outs)
            else:
                if fn is None:
                    raise UnsupportedOpError(f"unsupported ONNX op {op_type}")
                outs = fn(self, node, ins, self.runner.attributes(node, lw.attributes))
        except OnnxError as exc:
            raise type(exc)(f"{_where(self.model.path, node, label, op_type)}: {exc}") from None
        except Exception as exc:
            from flare.core.errors import FlareError
            if isinstance(exc, FlareError):
                raise OnnxError(f"{_where(self.model.path, node, label, op_type)}: {exc}") from None
            raise
        if len(outs) < named:
            raise OnnxError(f"{_where(self.model.path, node, label, op_type)}: produced {len(outs)} outputs, "
                            f"the node names {len(outputs)}")
        last_use, live, position = self.last_use, self.live_tensors, self.position
        for name, v in zip(outputs, outs):
            if not name or v is None:
                continue
            v.name = name
            env[name] = v
            last_use.setdefault(name, position)  # a branch's inner values live while its If runs
            if v.tensor is not None:
                live[name] = v

    def _fold_cached(self, node: Any, ins: list, fold: Any, key: tuple) -> list[Val]:
        """Fold a node; one whose inputs all come from the file is folded once per runner.
        `key`: (op type, input names, output names) (names are unique (SSA), proto ids are not)."""
        fixed = all(v is None or v.fixed for v in ins)
        cache = self.runner._folded
        if fixed and key in cache:
            return [Val("", v.shape, v.dtype, const=v.const, fixed=True) for v in cache[key]]
        by_value = None if fixed else _small_values_key(key, ins)
        memo = self.runner._folded_by_value
        if by_value is not None and by_value in memo:
            return [Val("", v.shape, v.dtype, const=v.const) for v in memo[by_value]]
        outs = fold(self, node, ins)
        if fixed:
            for v in outs:
                v.fixed = True
            cache[key] = [Val("", v.shape, v.dtype, const=v.const, fixed=True) for v in outs]
        elif by_value is not None:
            size = sum(getattr(v.const, "nbytes", 0) for v in outs)
            if size <= FOLD_MEMO_OUT_BYTES:
                runner = self.runner
                if len(memo) >= FOLD_MEMO or runner._folded_by_value_bytes + size > FOLD_MEMO_TOTAL:
                    memo.clear()
                    runner._folded_by_value_bytes = 0
                memo[by_value] = [Val("", v.shape, v.dtype, const=v.const) for v in outs]
                runner._folded_by_value_bytes += size
        return outs

    def run_branch(self, graph: Any) -> list[Val]:
        """The nodes of an If branch, in this trace (outer values visible), and its outputs."""
        from .loader import read_tensor

        for t in graph.initializer:
            arr = read_tensor(t, None, self.model.path)
            self.env[t.name] = Val(t.name, tuple(arr.shape), arr.dtype, const=arr, fixed=True)
        self._depth += 1
        try:
            for j, node in enumerate(graph.node):
                self.step(node, f"{graph.name}/{node.name or j}")
        finally:
            self._depth -= 1
        out = []
        for o in graph.output:
            v = self.env[o.name]
            out.append(Val("", v.shape, v.dtype, const=v.const, tensor=v.tensor, runtime=v.runtime, fixed=v.fixed))
        return out
