"""PreparedGraph: the session-owned lifecycle of one model graph.

prepare -> execute -> reset -> release.

- *prepare* builds each entry point's graph for its input shapes, schedules it
  over the session's devices, plans one arena per device, reserves memory
  (persistent weights/state/inputs, then workspace growth), and lets every
  device compile its splits. The whole step is a transaction: on any failure
  everything it allocated is released and the error propagates.
- *execute(entry, **inputs)* validates and writes inputs, runs the splits in
  order with the copies between devices, and returns the outputs. Inputs of a
  new shape get their own plan (cached); a plan bound to an older workspace
  generation re-binds first.
- *reset* zeroes per-request state and keeps memory and captures.
- *release* destroys captures, then persistent buffers, then lets go of the
  workspace. Idempotent; any later use raises ReleasedError.

Entry points (`full`, `body`, `prefill`, `decode`...) share the workspace, so
their arenas overlap: memory is the largest entry's need, not the sum.

Concurrency: a PreparedGraph may be shared between threads. Its public methods
serialise on a per-graph lock, and execute/prepare/reset also hold the
workspace's lock (graphs sharing a workspace share arena bytes, so they take
turns) and a use of every device (`Device.in_use`, so closing a device waits for
them). Lock order: session -> graph -> workspace -> device. `release()` waits for
an execute in flight; every call after it raises ReleasedError.

A graph dropped without `release()` is released by a `weakref.finalize` with a
ResourceWarning naming it; the session keeps only weak references to graphs.
"""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from .backend import Binding, Buffer, Device, PreparedSplit, SplitProgram
from .dtypes import to_numpy
from .errors import GraphError, InputError, ReleasedError
from .fusion import fuse, fusion_enabled
from .graph import INPUT, PERSISTENT, STATE, WEIGHT, Graph, GraphBuilder, Tensor, integer_shape
from .ops import OPS
from .planner import DevicePlan, plan_schedule
from .partition import Copy, PlacementFn, Schedule, Split, schedule
from .workspace import GraphWorkspace, Growth

if TYPE_CHECKING:
    from .session import Session

EntryBuilder = Callable[[GraphBuilder, Mapping[str, tuple]], None]
HostCallback = Callable[..., np.ndarray]
MAX_PLANS_PER_ENTRY = 8


@dataclass
class _CopyStep:
    copy: Copy
    src_device: Device
    src: Binding
    dst_device: Device
    dst: Binding
    staging: np.ndarray | None = None

    def run(self) -> None:
        sv = self.src_device.host_view(self.src)
        dv = self.dst_device.host_view(self.dst)
        if sv is not None and dv is not None:
            np.copyto(dv, sv)
        elif sv is not None:
            self.dst_device.write(self.dst, sv)
        elif dv is not None:
            self.src_device.read_into(self.src, dv)
        else:
            if self.staging is None:
                self.staging = np.empty(self.src.shape, to_numpy(self.src.dtype))
            self.src_device.read_into(self.src, self.staging)
            self.dst_device.write(self.dst, self.staging)


@dataclass
class EntryPlan:
    """One entry point prepared for one set of input shapes."""

    entry: str
    shapes: dict[str, tuple]
    graph: Graph
    schedule: Schedule
    device_plans: dict[str, DevicePlan]
    generation: int = -1
    persist_generation: int = -1
    programs: list[PreparedSplit | None] = field(default_factory=list)
    split_bindings: list[dict[int, Binding]] = field(default_factory=list)
    copy_steps: list[list[_CopyStep]] = field(default_factory=list)
    inputs: dict[str, tuple[Device, Binding]] = field(default_factory=dict)
    outputs: dict[str, tuple[Device, Binding]] = field(default_factory=dict)
    prepare_s: float = 0.0  # wall seconds of the prepare that built this plan (graph, plan, memory, compile)

    def release_captures(self) -> None:
        for prog in self.programs:
            if prog is not None:
                prog.release()
        self.programs = []
        self.generation = -1


class PreparedGraph:
    """See the module docstring. Obtain one from `Session.prepare`.

    Thread-safe: executes (and prepare, reset, release, describe) on one graph
    serialise on its lock, so concurrent callers get the outputs a sequential
    run would give; graphs on one workspace also take turns. Release during an
    execute waits for it; later calls raise ReleasedError.
    """

    def __init__(
        self,
        session: "Session",
        entries: Mapping[str, EntryBuilder],
        shapes: Mapping[str, Mapping[str, Sequence[int]]],
        *,
        workspace: GraphWorkspace,
        placement: PlacementFn | None = None,
        strict: bool = False,
        name: str = "graph",
        callbacks: Mapping[str, HostCallback] | None = None,
        tuning: Mapping[str, Mapping[str, str]] | None = None,
    ):
        unknown = set(shapes) - set(entries)
        if unknown:
            raise GraphError(f"shapes given for unknown entry points {sorted(unknown)}; entries are {sorted(entries)}")
        self.session = session
        self.name = name
        self.entries = dict(entries)
        self.workspace = workspace
        self.placement = placement
        self.strict = strict
        self.callbacks = dict(callbacks or {})
        # entry -> {"BACKEND.op": variant}: tuned kernel variants (from an exported core)
        self.tuning = {e: dict(t) for e, t in (tuning or {}).items()}
        self.devices = {d.name: d for d in session.devices}
        self._plans: dict[str, OrderedDict[tuple, EntryPlan]] = {e: OrderedDict() for e in entries}
        # plans kept per entry (least recently used dropped first); a model whose shapes vary
        # more (exact sequence lengths) may raise it: a plan is host objects, its arena is the workspace's
        self.max_plans = MAX_PLANS_PER_ENTRY
        self._current: dict[str, EntryPlan] = {}
        self._weights: dict[tuple[str, str], Buffer] = {}
        self._states: dict[str, tuple[str, Buffer, Tensor]] = {}
        self._inputs: dict[tuple[str, str], Buffer] = {}
        self._persist_generation = 0
        self.released = False
        self.stats = {"plans_built": 0, "rebinds": 0, "executes": 0}
        self._hook = session.plugins.hook   # observers: flare_graph_prepared/executed/reset/released
        self._lock = threading.RLock()
        self._executing = False  # an execute holds the graph: its host callbacks' helpers need no lock
        self.workspace.attach()
        # releases what a graph dropped without release() still holds (never references self)
        self._finalizer = weakref.finalize(self, _release_dropped, name, self._plans, self._inputs, self._states,
                                           self._weights, workspace)
        self._finalizer.atexit = False
        try:
            for entry, entry_shapes in shapes.items():
                self.prepare(entry, entry_shapes)
        except BaseException:
            self.release()
            raise

    # ------------------------------------------------------------------ public
    def prepare(self, entry: str, shapes: Mapping[str, Sequence[int]]) -> EntryPlan:
        """Plan, reserve and compile `entry` for input `shapes` (cached per shapes)."""
        with self._guard():
            return self._prepare_impl(entry, shapes, replan=False)

    def execute(self, entry: str, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """Run `entry` on `inputs`; returns a dict of output arrays (fresh copies)."""
        with self._guard():
            self._executing = True
            try:
                return self._execute(entry, inputs)
            finally:
                self._executing = False

    def _execute(self, entry: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        plan = self._plan_for_inputs(entry, inputs)
        for name, (dev, binding) in plan.inputs.items():
            dev.write(binding, inputs[name])
        for split, prog, steps in zip(plan.schedule.splits, plan.programs, plan.copy_steps):
            for step in steps:
                step.run()
            if split.host:
                self._run_host(split, plan.split_bindings[split.index])
            else:
                prog.run()
        self.stats["executes"] += 1
        outputs = {name: dev.read(binding) for name, (dev, binding) in plan.outputs.items()}
        self._hook.flare_graph_executed(graph=self, entry=entry, seconds=time.perf_counter() - start)
        return outputs

    def reset(self) -> None:
        """Zero per-request state (LSTM state, KV caches). Memory and captures stay."""
        with self._guard():
            for dev_name, buf, tensor in self._states.values():
                if tensor.role == STATE:
                    dev = self.devices[dev_name]
                    dev.fill_zero(Binding(buf, 0, tensor.shape, tensor.strides, tensor.dtype))
            self._hook.flare_graph_reset(graph=self)

    def release(self) -> None:
        """Captures, then persistent buffers, then the workspace reference. Idempotent.

        Waits for an execute in flight on another thread (the graph's lock)."""
        with self._lock:
            if self.released:
                return
            self._release_impl()
            self._hook.flare_graph_released(graph=self)

    def describe(self) -> dict[str, Any]:
        """Splits, copies, bytes copied, arena bytes per device and prepare seconds for each prepared entry."""
        with self._lock:
            self._check_alive()
            return self._describe()

    def _describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "entries": {}, "persistent_bytes": self.persistent_bytes(),
                               "workspace_bytes": {d: self.workspace.nbytes(d) for d in self.devices}}
        for entry, plan in self._current.items():
            info = plan.schedule.summary()
            info["shapes"] = {k: list(v) for k, v in plan.shapes.items()}
            info["nodes"] = len(plan.graph.nodes)
            info["arena"] = {d: {"planned": p.total, "lower_bound": p.lower_bound, "naive": p.naive,
                                 "chunks": p.chunks, "inplace": p.inplace} for d, p in plan.device_plans.items()}
            info["split_list"] = [{"device": s.device, "nodes": len(s.nodes), "host": s.host,
                                   "copies": [f"{c.src.name} {c.src_device}->{c.dst_device} ({c.nbytes} B)" for c in s.copies],
                                   **(prog.describe() if prog is not None else {})}
                                  for s, prog in zip(plan.schedule.splits, plan.programs or [None] * len(plan.schedule.splits))]
            info["fusions"] = [str(f) for f in plan.graph.fusions]
            # prepare time, and per split what the backend says its compile cost (Vulkan:
            # pipelines built, primed, from the pipeline cache, seconds)
            info["prepare_s"] = round(plan.prepare_s, 4)
            out["entries"][entry] = info
        return out

    def persistent_bytes(self) -> dict[str, int]:
        per: dict[str, int] = {}
        for (_, dev), buf in list(self._weights.items()) + list(self._inputs.items()):
            per[dev] = per.get(dev, 0) + buf.nbytes
        for dev, buf, _ in self._states.values():
            per[dev] = per.get(dev, 0) + buf.nbytes
        return per

    def state(self, name: str) -> np.ndarray:
        """Read a state/cache tensor back to the host (for tests and debugging)."""
        with self._callback_guard():
            dev, buf, t = self._states[name]
            return self.devices[dev].read(Binding(buf, 0, t.shape, t.strides, t.dtype))

    def states(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """Every state/cache tensor: name -> (device name, shape, dtype)."""
        return {name: (dev, tuple(t.shape), t.dtype) for name, (dev, _, t) in self._states.items()}

    def _row_binding(self, name: str, row: int, rows: int) -> tuple[str, Binding]:
        dev, buf, t = self._states[name]
        row_elems = int(np.prod(t.shape[1:], dtype=np.int64))
        if rows < 0 or row < 0 or row + rows > t.shape[0]:
            raise InputError(f"rows [{row}, {row + rows}) are outside {name!r} {t.shape}")
        itemsize = to_numpy(t.dtype).itemsize
        return dev, Binding(buf, row * row_elems * itemsize, (rows, *t.shape[1:]),
                            (row_elems, *t.strides[1:]) if len(t.shape) > 1 else (1,), t.dtype)

    def read_rows(self, name: str, row: int, rows: int) -> np.ndarray:
        """Rows [row, row+rows) of a state/cache tensor, read back to the host (KV reuse, tests)."""
        with self._callback_guard():
            dev, binding = self._row_binding(name, row, rows)
            return self.devices[dev].read(binding)

    def write_rows(self, name: str, row: int, array: np.ndarray) -> None:
        """Write `array` into rows [row, row+len) of a state/cache tensor (host callbacks use it)."""
        with self._callback_guard():
            self._write_rows(name, row, array)

    def _write_rows(self, name: str, row: int, array: np.ndarray) -> None:
        dev, buf, t = self._states[name]
        array = np.ascontiguousarray(array, to_numpy(t.dtype))
        row_elems = int(np.prod(t.shape[1:], dtype=np.int64))
        if array.size % row_elems or row < 0 or row + array.size // row_elems > t.shape[0]:
            raise InputError(f"write_rows: {array.shape} at row {row} does not fit {name!r} {t.shape}")
        rows = array.size // row_elems
        binding = Binding(buf, row * row_elems * array.itemsize, (rows, *t.shape[1:]),
                          (row_elems, *t.strides[1:]) if len(t.shape) > 1 else (1,), t.dtype)
        self.devices[dev].write(binding, array.reshape(binding.shape))

    def current_plan(self, entry: str) -> EntryPlan:
        return self._current[entry]

    def __enter__(self) -> "PreparedGraph":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # ------------------------------------------------------------ lifecycle impl
    def _check_alive(self) -> None:
        if self.released:
            raise ReleasedError(f"prepared graph {self.name!r} was released")

    def _callback_guard(self) -> contextlib.AbstractContextManager:
        """For `state`/`write_rows`: during an execute they are part of it — called by a host
        callback or by a thread it hands work to (expert prefetch) while the execute waits —
        so they take nothing (taking the lock from a helper thread would deadlock); outside
        an execute they take the full guard."""
        if self._executing:
            self._check_alive()
            return contextlib.nullcontext()
        return self._guard()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """The graph's lock, then its workspace's, then a use of every device; refuses after release."""
        with self._lock:
            self._check_alive()
            with self.workspace.lock, contextlib.ExitStack() as uses:
                for dev in self.devices.values():
                    uses.enter_context(dev.in_use())
                yield

    def _prepare_impl(self, entry: str, shapes: Mapping[str, Sequence[int]], replan: bool) -> EntryPlan:
        if entry not in self.entries:
            raise InputError(f"unknown entry point {entry!r}; {self.name} has {sorted(self.entries)}")
        shapes = {k: integer_shape(v, f"{self.name}.{entry} input {k!r}") for k, v in shapes.items()}
        key = tuple(sorted(shapes.items()))
        cache = self._plans[entry]
        if key in cache:
            cache.move_to_end(key)
            plan = cache[key]
            self._bind(plan)
            self._current[entry] = plan
            return plan
        start = time.perf_counter()
        b = GraphBuilder()
        self.entries[entry](b, shapes)
        graph = b.build()
        graph.validate()
        pinned = {name: dev for name, (dev, _, _) in self._states.items()}
        pinned.update({name: dev for (name, dev) in self._weights})
        sched = schedule(graph, list(self.devices.values()), self.placement, pinned, self.strict)
        if fusion_enabled():
            sched = self._fuse(graph, sched, pinned)
        plans = self._plan_memory(sched)
        plan = EntryPlan(entry, shapes, graph, sched, plans)
        self._bind(plan, fresh=True)
        cache[key] = plan
        self.stats["plans_built"] += 1
        while len(cache) > self.max_plans:
            _, old = cache.popitem(last=False)
            old.release_captures()
        self._current[entry] = plan
        plan.prepare_s = time.perf_counter() - start
        self._hook.flare_graph_prepared(graph=self, entry=entry, shapes=dict(shapes), replan=replan,
                                        seconds=plan.prepare_s)
        return plan

    def _release_impl(self) -> None:
        self._finalizer.detach()
        self._current.clear()
        self.released = True
        try:
            _release_resources(self._plans, self._inputs, self._states, self._weights, self.workspace)
        finally:
            self.session._forget(self)

    # ---------------------------------------------------------------- internals
    def _fuse(self, graph: Graph, sched: Schedule, pinned: dict[str, str]) -> Schedule:
        """Merge chains that sit on one device supporting the fused op (flare.core.fusion), then
        partition the rewritten graph with each fused node pinned where its chain was."""
        where = sched.device_of

        def accept(candidate: Tensor, chain: list[Tensor]) -> bool:
            devs = {where.get(t.id) for t in chain}
            return len(devs) == 1 and None not in devs and self.devices[devs.pop()].supports(candidate)

        graph.fusions = fuse(graph, accept)
        if not graph.fusions:
            return sched
        pins = {**pinned, **{t.name: where[t.id] for t in graph.nodes if t.id in where and OPS[t.op].fused}}
        return schedule(graph, list(self.devices.values()), self.placement, pins, self.strict)

    def _plan_for_inputs(self, entry: str, inputs: Mapping[str, np.ndarray]) -> EntryPlan:
        if entry not in self.entries:
            raise InputError(f"unknown entry point {entry!r}; {self.name} has {sorted(self.entries)}")
        plan = self._current.get(entry)
        if plan is None:
            raise InputError(f"entry point {entry!r} of {self.name} was not prepared; call prepare({entry!r}, shapes)")
        expected = plan.graph.inputs
        missing = sorted(set(expected) - set(inputs))
        extra = sorted(set(inputs) - set(expected))
        if missing or extra:
            raise InputError(f"{self.name}.{entry}: missing inputs {missing}, unknown inputs {extra}; expects {sorted(expected)}")
        shapes = {}
        for name, t in expected.items():
            arr = inputs[name]
            if not isinstance(arr, np.ndarray):
                raise InputError(f"{self.name}.{entry}: input {name!r} is a {type(arr).__name__}, not a numpy array")
            if arr.dtype != to_numpy(t.dtype):
                raise InputError(f"{self.name}.{entry}: input {name!r} has dtype {arr.dtype}, expected {to_numpy(t.dtype)}")
            if arr.ndim != len(t.shape):
                raise InputError(f"{self.name}.{entry}: input {name!r} has shape {arr.shape}, expected rank {len(t.shape)} like {t.shape}")
            shapes[name] = tuple(arr.shape)
        if shapes != plan.shapes:
            plan = self._prepare_impl(entry, shapes, replan=True)   # new shapes: re-plan (and grow if needed)
        else:
            self._bind(plan)
        return plan

    def _plan_memory(self, sched: Schedule) -> dict[str, DevicePlan]:
        return plan_schedule(sched, self.devices)

    def reserve(self, entry: str, shapes: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """Dry run: arena chunk sizes per device `entry` would need for `shapes`. Allocates nothing."""
        with self._lock:
            self._check_alive()
            return self._reserve(entry, shapes)

    def _reserve(self, entry: str, shapes: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        b = GraphBuilder()
        self.entries[entry](b, {k: tuple(v) for k, v in shapes.items()})
        graph = b.build()
        sched = schedule(graph, list(self.devices.values()), self.placement, None, self.strict)
        return {d: p.chunks for d, p in self._plan_memory(sched).items() if p.chunks}

    # -- binding: persistent memory, workspace growth, compile ---------------
    def _bind(self, plan: EntryPlan, fresh: bool = False) -> None:
        """Make `plan` runnable against current memory; a no-op when already bound."""
        if (not fresh and plan.programs and plan.generation == self.workspace.generation
                and plan.persist_generation == self._persist_generation):
            return
        if not fresh:
            self.stats["rebinds"] += 1
        old_programs, plan.programs = plan.programs, []
        new_buffers: list[Buffer] = []
        retired: list[tuple[tuple[str, str], Buffer]] = []
        growth: Growth | None = None
        programs: list[PreparedSplit | None] = []
        try:
            grew_persistent = self._reserve_persistent(plan, new_buffers, retired)
            needs = {self.devices[d]: p.chunks for d, p in plan.device_plans.items() if p.chunks}
            growth = self.workspace.grow(needs)
            self._make_bindings(plan, growth)
            for split in plan.schedule.splits:
                old = old_programs[split.index] if old_programs else None
                if split.host:
                    programs.append(None)
                    continue
                dev = self.devices[split.device]
                program = SplitProgram(dev, split.nodes, plan.split_bindings[split.index],
                                       self._tuning_for(plan.entry, dev))
                if old is not None and old.rebind(program):
                    programs.append(old)   # updated in place (e.g. cuGraphExecUpdate)
                    continue
                if old is not None:
                    old.release()
                programs.append(dev.compile(program))
        except BaseException:
            for prog in {id(p): p for p in programs + list(old_programs) if p is not None}.values():
                prog.release()
            if growth is not None:
                growth.abort()
            self._forget(new_buffers, retired)
            raise
        growth.commit()
        for _, buf in retired:
            buf.release()
        if grew_persistent:
            self._persist_generation += 1
        plan.programs = programs
        plan.generation = self.workspace.generation
        plan.persist_generation = self._persist_generation

    def _tuning_for(self, entry: str, dev: Device) -> dict[str, str]:
        prefix = f"{dev.backend}."
        return {k[len(prefix):]: v for k, v in self.tuning.get(entry, {}).items() if k.startswith(prefix)}

    def _forget(self, buffers: list[Buffer], retired: list[tuple]) -> None:
        """Undo persistent allocations of a failed attempt (and restore retired ones)."""
        ids = {id(b) for b in buffers}
        for key in [k for k, b in self._weights.items() if id(b) in ids]:
            del self._weights[key]
        for key in [k for k, v in self._states.items() if id(v[1]) in ids]:
            del self._states[key]
        for key in [k for k, b in self._inputs.items() if id(b) in ids]:
            del self._inputs[key]
        for buf in buffers:
            buf.release()
        for key, buf in retired:
            self._inputs[key] = buf
        retired.clear()

    def _reserve_persistent(self, plan: EntryPlan, new: list[Buffer], retired: list) -> bool:
        """Weights (uploaded once), state (shared by name), input buffers (grown to the max)."""
        sched = plan.schedule
        grew = False
        for t in plan.graph.tensors:
            if t.op is not None:
                continue
            dev_name = sched.device_of[t.id]
            dev = self.devices[dev_name]
            if t.role == WEIGHT:
                if (t.name, dev_name) not in self._weights:
                    data = np.ascontiguousarray(t.host_data())
                    if data.shape != t.shape or data.dtype != to_numpy(t.dtype):
                        raise GraphError(f"weight data is {data.shape} {data.dtype}, declared {t.shape} {t.dtype}", t.name)
                    buf = dev.alloc(t.nbytes, tag=f"{self.name}:weight:{t.name}")
                    new.append(buf)
                    self._weights[(t.name, dev_name)] = buf
                    dev.write(Binding(buf, 0, t.shape, t.strides, t.dtype), data)
            elif t.role in PERSISTENT:
                have = self._states.get(t.name)
                if have is None:
                    buf = dev.alloc(t.nbytes, tag=f"{self.name}:{t.role}:{t.name}")
                    new.append(buf)
                    self._states[t.name] = (dev_name, buf, t)
                    dev.fill_zero(Binding(buf, 0, t.shape, t.strides, t.dtype))
                elif have[2].shape != t.shape or have[2].dtype != t.dtype or have[0] != dev_name:
                    raise GraphError(f"{t.role} declared as {t.shape} {t.dtype} on {dev_name}, but an earlier entry "
                                     f"declared {have[2].shape} {have[2].dtype} on {have[0]}", t.name)
            elif t.role == INPUT:
                key = (t.name, dev_name)
                old = self._inputs.get(key)
                if old is None or old.nbytes < t.nbytes:
                    buf = dev.alloc(t.nbytes, tag=f"{self.name}:input:{t.name}")
                    new.append(buf)
                    self._inputs[key] = buf
                    if old is not None:
                        retired.append((key, old))
                        grew = True
        return grew

    def _home_location(self, plan: EntryPlan, growth: Growth, storage: Tensor) -> tuple[Buffer, int]:
        dev = plan.schedule.device_of[storage.id]
        if storage.op is None:
            if storage.role == WEIGHT:
                return self._weights[(storage.name, dev)], 0
            if storage.role == INPUT:
                return self._inputs[(storage.name, dev)], 0
            return self._states[storage.name][1], 0
        p = plan.device_plans[dev].placements[storage.id]
        return growth.chunk(dev, p.chunk), p.offset

    def _make_bindings(self, plan: EntryPlan, growth: Growth) -> None:
        sched = plan.schedule

        def bind(t: Tensor, buf: Buffer, base: int) -> Binding:
            return Binding(buf, base + t.offset * np.dtype(to_numpy(t.dtype)).itemsize, t.shape, t.strides, t.dtype)

        plan.split_bindings, plan.copy_steps = [], []
        for split in sched.splits:
            bindings: dict[int, Binding] = {}
            steps: list[_CopyStep] = []
            for c in split.copies:
                dst_p = plan.device_plans[split.device].placements[c.key]
                src_buf, src_off = self._home_location(plan, growth, c.src)
                dst_buf = growth.chunk(split.device, dst_p.chunk)
                full = Tensor(c.src.id, c.src.name, c.src.shape, c.src.dtype)
                steps.append(_CopyStep(c, self.devices[c.src_device], bind(full, src_buf, src_off),
                                       self.devices[split.device], bind(full, dst_buf, dst_p.offset)))
            for node in split.nodes:
                for t in (node, *node.srcs):
                    st = t.storage
                    copy = split.copy_of(st)
                    if copy is not None:
                        p = plan.device_plans[split.device].placements[copy.key]
                        buf, base = growth.chunk(split.device, p.chunk), p.offset
                    else:
                        buf, base = self._home_location(plan, growth, st)
                    bindings[t.id] = bind(t, buf, base)
            plan.split_bindings.append(bindings)
            plan.copy_steps.append(steps)
        plan.inputs = {}
        for name, t in plan.graph.inputs.items():
            dev = sched.device_of[t.id]
            plan.inputs[name] = (self.devices[dev], bind(t, self._inputs[(name, dev)], 0))
        plan.outputs = {}
        for name, t in plan.graph.outputs.items():
            buf, base = self._home_location(plan, growth, t.storage)
            plan.outputs[name] = (self.devices[sched.device_of[t.storage.id]], bind(t, buf, base))

    def _run_host(self, split: Split, bindings: Mapping[int, Binding]) -> None:
        node = split.nodes[0]
        dev = self.devices[split.device]
        cb = self.callbacks.get(node.params["callback"])
        if cb is None:
            raise InputError(f"{self.name}: no host callback {node.params['callback']!r} for node {node.name!r}")
        arrays = [dev.read(bindings[s.id]) for s in node.srcs]
        result = np.asarray(cb(node, *arrays, ctx=self))
        if result.shape != node.shape:
            raise InputError(f"host callback {node.params['callback']!r} returned {result.shape}, node {node.name!r} expects {node.shape}")
        dev.write(bindings[node.id], result.astype(to_numpy(node.dtype), copy=False))


def _release_resources(plans: Mapping[str, OrderedDict], inputs: dict, states: dict, weights: dict,
                       workspace: GraphWorkspace) -> None:
    """Captures, then persistent buffers, then the workspace reference; reports the first failure.

    Module-level (and holding the containers, not the graph) so the finalizer of a
    dropped graph can run it without keeping the graph alive."""
    first_error: BaseException | None = None
    for cache in plans.values():                    # 1. captures
        for plan in cache.values():
            try:
                plan.release_captures()
            except BaseException as exc:  # keep releasing; report the first failure
                first_error = first_error or exc
        cache.clear()
    for buf in list(inputs.values()) + [b for _, b, _ in states.values()] + list(weights.values()):
        try:                                          # 2. persistent buffers
            buf.release()
        except BaseException as exc:
            first_error = first_error or exc
    inputs.clear()
    states.clear()
    weights.clear()
    workspace.detach()                                # 3. the workspace reference
    if first_error is not None:
        raise first_error


def _release_dropped(name: str, plans: Mapping[str, OrderedDict], inputs: dict, states: dict, weights: dict,
                     workspace: GraphWorkspace) -> None:
    """Finalizer of a PreparedGraph garbage-collected without release()."""
    held = len(inputs) + len(states) + len(weights)
    warnings.warn(f"prepared graph {name!r} was dropped without release(); releasing its {held} persistent "
                  f"buffer(s) and captures now", ResourceWarning, stacklevel=2)
    _release_resources(plans, inputs, states, weights, workspace)
