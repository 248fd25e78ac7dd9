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

This module is the lifecycle, its locks and the public surface. The roles it
delegates live beside it: planning and the plan cache (`planning.py`: one path
for `prepare` and its dry run `reserve`), persistent buffers (`persistent.py`),
bindings, copies and compiling (`bindings.py`), state and cache rows read and
written from the host (`state_rows.py`), host-callback nodes (`host_calls.py`).
"""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from . import state_rows
from .backend import Binding, Device
from .bindings import CopyStep, bind, tuning_for
from .errors import GraphError, InputError, ReleasedError
from .dtypes import to_numpy
from .graph import STATE, Tensor, integer_shape
from .host_calls import HostCallback
from .ops import OPS
from .partition import PlacementFn
from .persistent import PersistentStore
from .planning import MAX_PLANS_PER_ENTRY, EntryBuilder, EntryPlan, PlanCache, plan_entry
from .workspace import GraphWorkspace

if TYPE_CHECKING:
    from .session import Session

__all__ = ["PreparedGraph", "EntryPlan", "EntryBuilder", "HostCallback", "MAX_PLANS_PER_ENTRY"]
_CopyStep = CopyStep   # the name before the split into modules


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
        self._device_list = tuple(self.devices.values())
        self.plans = PlanCache(entries)
        self.persistent = PersistentStore(name)
        self.released = False
        self.stats = {"plans_built": 0, "rebinds": 0, "executes": 0}
        self._hook = session.plugins.hook   # observers: flare_graph_prepared/executed/reset/released
        self._lock = threading.RLock()
        self._executing = False  # an execute holds the graph: its host callbacks' helpers need no lock
        self.workspace.attach()
        # releases what a graph dropped without release() still holds (never references self)
        self._finalizer = weakref.finalize(self, _release_dropped, name, self.plans, self.persistent, workspace)
        self._finalizer.atexit = False
        try:
            for entry, entry_shapes in shapes.items():
                self.prepare(entry, entry_shapes)
        except BaseException:
            self.release()
            raise

    # the plan cache's knobs and views, under the names callers have used
    @property
    def max_plans(self) -> int:
        return self.plans.max_plans

    @max_plans.setter
    def max_plans(self, value: int) -> None:
        self.plans.max_plans = int(value)

    @property
    def _current(self) -> dict[str, EntryPlan]:
        return self.plans.current

    # ------------------------------------------------------------------ public
    def prepare(self, entry: str, shapes: Mapping[str, Sequence[int]]) -> EntryPlan:
        """Plan, reserve and compile `entry` for input `shapes` (cached per shapes)."""
        with self._guard():
            return self._prepare_impl(entry, shapes, replan=False)

    def replan(self) -> None:
        """Plan and compile every entry's current shapes again, dropping the other cached plans:
        for a host callback whose `runs_in_walk` answer changed after prepare (expert staging
        switched between the command inside a device's split and its host node)."""
        with self._guard():
            current = [(entry, plan.shapes) for entry, plan in self.plans.current.items()]
            self.plans.release()
            for cache in self.plans.plans.values():
                cache.clear()
            self.plans.current.clear()
            for entry, shapes in current:
                self._prepare_impl(entry, shapes, replan=True)

    def reserve(self, entry: str, shapes: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """Dry run of `prepare`: the arena chunk sizes per device `entry` would need for
        `shapes`, from the same planning path (validation, pinning, fusion). Allocates nothing."""
        with self._lock:
            self._check_alive()
            return self._plan(entry, self._shapes(entry, shapes)).chunks()

    def execute(self, entry: str, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """Run `entry` on `inputs`; returns a dict of output arrays (fresh copies)."""
        # the guard spelled out (no generator, no ExitStack for one device): it is paid per step
        with self._lock:
            self._check_alive()
            with self.workspace.lock, _uses(self._device_list):
                self._executing = True
                try:
                    return self._execute(entry, inputs)
                finally:
                    self._executing = False

    def reset(self) -> None:
        """Zero per-request state (LSTM state, KV caches). Memory and captures stay."""
        with self._guard():
            for dev_name, buf, tensor in self.persistent.states.values():
                if tensor.role == STATE:
                    self.devices[dev_name].fill_zero(Binding(buf, 0, tensor.shape, tensor.strides, tensor.dtype))
            self._hook.flare_graph_reset(graph=self)

    def release(self) -> None:
        """Captures, then persistent buffers, then the workspace reference. Idempotent.

        Waits for an execute in flight on another thread (the graph's lock)."""
        with self._lock:
            if self.released:
                return
            self._finalizer.detach()
            self.released = True
            try:
                _release_resources(self.plans, self.persistent, self.workspace)
            finally:
                self.session._forget(self)
            self._hook.flare_graph_released(graph=self)

    def describe(self) -> dict[str, Any]:
        """Splits (with node names), copies, bytes copied, arena bytes per device, fusions,
        placement fallbacks and prepare seconds for each prepared entry."""
        with self._lock:
            self._check_alive()
            return self._describe()

    def persistent_bytes(self) -> dict[str, int]:
        return self.persistent.nbytes()

    def current_plan(self, entry: str) -> EntryPlan:
        return self.plans.current[entry]

    def tuning_for(self, entry: str, device: Any) -> dict[str, str]:
        """The kernel variants (op -> variant) `device`'s splits of `entry` are compiled with."""
        return tuning_for(self.tuning.get(entry, {}), device)

    # -- state and cache tensors from the host (state_rows.py) -----------------
    def state(self, name: str) -> np.ndarray:
        """Read a state/cache tensor back to the host (for tests and debugging)."""
        with self._callback_guard():
            dev, binding = state_rows.whole(self.persistent, name)
            return self.devices[dev].read(binding)

    def states(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """Every state/cache tensor: name -> (device name, shape, dtype)."""
        return {name: (dev, tuple(t.shape), t.dtype) for name, (dev, _, t) in self.persistent.states.items()}

    def read_rows(self, name: str, row: int, rows: int) -> np.ndarray:
        """Rows [row, row+rows) of a state/cache tensor, read back to the host (KV reuse, tests)."""
        with self._callback_guard():
            dev, binding = state_rows.rows(self.persistent, name, row, rows)
            return self.devices[dev].read(binding)

    def host_rows(self, name: str) -> np.ndarray | None:
        """A state/cache tensor's memory as a (rows, bytes per row) uint8 array where the host
        addresses it (a CPU device), else None. For a caller that copies rows between executes on
        the thread that runs them (a prefix cache storing and loading KV blocks: 60 tensors a
        block on SmolLM2): a slice copy each, with no lock, checks or new view per copy, which
        `read_rows` spends tens of us on. Valid until `release()`; the caller drops it first."""
        with self._guard():
            if name not in self.persistent.states:
                raise InputError(f"{self.name}: no state or cache tensor {name!r}")
            return state_rows.host_row_bytes(self.persistent, self.devices, name)

    def write_rows(self, name: str, row: int, array: np.ndarray) -> None:
        """Write `array` into rows [row, row+len) of a state/cache tensor (host callbacks use it)."""
        with self._callback_guard():
            state_rows.write_rows(self.persistent, self.devices, name, row, array)

    def hold(self) -> contextlib.AbstractContextManager:
        """The graph's own (re-entrant) lock, for a caller that must do something right before an
        execute with no other thread's call in between (a model queueing an expert prefetch for
        the step it is about to run); `execute` inside it takes the same lock again."""
        return self._lock

    def row_writer(self, name: str) -> Callable[[int, np.ndarray], None]:
        """`write_rows` for one state/cache tensor that takes no lock, for a helper thread of a
        host callback's owner (expert prefetch) whose copies may run on between executes, where
        `write_rows` would take the graph's lock and deadlock against an execute waiting for the
        helper. The owner keeps the helper off rows an execute uses and stops it before
        `release()`. Only for tensors on a CPU device (host memory: a write is a copy with no
        queue to order it against); InputError otherwise."""
        self._check_host_state(name)
        store, devices = self.persistent, self.devices
        return lambda row, array: state_rows.write_rows(store, devices, name, row, array)

    def _check_host_state(self, name: str) -> None:
        """What a lock-free row writer needs: a live graph and a state tensor in host memory."""
        with self._lock:
            self._check_alive()
            if name not in self.persistent.states:
                raise InputError(f"{self.name}: no state or cache tensor {name!r}")
            dev = self.persistent.states[name][0]
            if self.devices[dev].backend != "cpu":
                raise InputError(f"{self.name}: {name!r} is on {dev}, not in host memory: a lock-free writer "
                                 f"would race the device's queue")

    def row_byte_writer(self, name: str, like: np.ndarray | None = None) -> Callable[[int, np.ndarray], None]:
        """`row_writer`'s contract, but the rows come as their bytes (uint8 [count, bytes per row]):
        for copying rows stored exactly as the tensor holds them (quantized experts of a mapped
        file) with no per-call conversion (`state_rows.byte_row_writer`). `like`: rows the caller
        will take the bytes of; InputError unless their dtype and row shape are the tensor's."""
        self._check_byte_rows(name, like)
        return state_rows.byte_row_writer(self.persistent, self.devices, name)

    def row_byte_run_writer(self, name: str, like: np.ndarray | None = None) -> Callable[..., None]:
        """`row_byte_writer` taking several runs per call: `write(runs, source_bytes)` with runs of
        (first source row, first row, count) (`state_rows.byte_run_writer`): expert staging's
        copies of one step, one call per tensor."""
        self._check_byte_rows(name, like)
        return state_rows.byte_run_writer(self.persistent, self.devices, name)

    def row_byte_target(self, name: str, like: np.ndarray | None = None) -> tuple[Device, Callable[[], np.ndarray]]:
        """For a host-memory state or cache tensor: (its device, a function giving its memory as
        uint8 [rows, bytes per row], looked up on each call: InputError once released). For
        writers outside Python (a device's `expert_stage_step`); `like` as `row_byte_writer`'s."""
        self._check_byte_rows(name, like)
        return self.devices[self.persistent.states[name][0]], state_rows.byte_target(self.persistent, self.devices, name)

    def _check_byte_rows(self, name: str, like: np.ndarray | None) -> None:
        self._check_host_state(name)
        if like is not None:
            t = self.persistent.states[name][2]
            if like.dtype != np.dtype(to_numpy(t.dtype)) or tuple(like.shape[1:]) != tuple(t.shape[1:]):
                raise InputError(f"{self.name}: rows {like.dtype} {like.shape[1:]} are not {name!r}'s "
                                 f"{t.dtype} {t.shape[1:]}")

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
            with self.workspace.lock, _uses(self._device_list):
                yield

    def _shapes(self, entry: str, shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple]:
        if entry not in self.entries:
            raise InputError(f"unknown entry point {entry!r}; {self.name} has {sorted(self.entries)}")
        return {k: integer_shape(v, f"{self.name}.{entry} input {k!r}") for k, v in shapes.items()}

    def _plan(self, entry: str, shapes: Mapping[str, tuple]) -> EntryPlan:
        """The one planning path (planning.plan_entry), with persistent tensors pinned where they live."""
        return plan_entry(entry, self.entries[entry], shapes, self.devices, self.placement,
                          self.persistent.pins(), self.strict, self._in_walk)

    def _in_walk(self, node: Any, device: str) -> bool:
        """Whether host node `node` runs inside `device`'s split (its callback's `runs_in_walk`)."""
        cb = self.callbacks.get(node.params.get("callback"))
        ask = getattr(cb, "runs_in_walk", None)
        return bool(ask is not None and ask(node, self.devices[device]))

    def _bind(self, plan: EntryPlan, fresh: bool = False) -> None:
        if bind(plan, self.devices, self.workspace, self.persistent, self.tuning.get(plan.entry, {}), fresh,
                (self.callbacks, self)) and not fresh:
            self.stats["rebinds"] += 1

    def _prepare_impl(self, entry: str, shapes: Mapping[str, Sequence[int]], replan: bool) -> EntryPlan:
        shapes = self._shapes(entry, shapes)
        plan = self.plans.get(entry, shapes)
        if plan is not None:
            self._bind(plan)
            self.plans.current[entry] = plan
            return plan
        start = time.perf_counter()
        plan = self._plan(entry, shapes)
        self._bind(plan, fresh=True)
        self.plans.put(plan)
        self.stats["plans_built"] += 1
        plan.prepare_s = time.perf_counter() - start
        self._hook.flare_graph_prepared(graph=self, entry=entry, shapes=dict(shapes), replan=replan,
                                        seconds=plan.prepare_s)
        return plan

    def _execute(self, entry: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        plan = self._plan_for_inputs(entry, inputs)
        for name, dev, binding, view in plan.input_writes:
            if view is not None:
                view[...] = inputs[name]   # the CPU device's write (dtype checked equal above)
            else:
                dev.write(binding, inputs[name])
        host_steps = plan.host_steps
        for split, prog, steps in zip(plan.schedule.splits, plan.programs, plan.copy_steps):
            for step in steps:
                step.run()
            if split.host:
                host_steps[split.index].run(self.name, self.callbacks, self)
            else:
                prog.run()
        self.stats["executes"] += 1
        outputs = {name: dev.read(binding) if view is None else view.copy()
                   for name, dev, binding, view in plan.output_reads}
        executed = self._hook.flare_graph_executed
        if executed.get_hookimpls():   # a call with no observer costs ~1.3 us of a ~55 us decode step
            executed(graph=self, entry=entry, seconds=time.perf_counter() - start)
        return outputs

    def _plan_for_inputs(self, entry: str, inputs: Mapping[str, np.ndarray]) -> EntryPlan:
        plan = self.plans.current.get(entry)
        if plan is not None and plan.input_check and len(inputs) == len(plan.input_check):
            # fast path: the current plan's exact names, dtypes and shapes (every decode step)
            for name, dtype, shape in plan.input_check:
                arr = inputs.get(name)
                if type(arr) is not np.ndarray or arr.dtype != dtype or arr.shape != shape:
                    break
            else:
                self._bind(plan)
                return plan
        return self._plan_for_inputs_checked(entry, inputs)

    def _plan_for_inputs_checked(self, entry: str, inputs: Mapping[str, np.ndarray]) -> EntryPlan:
        if entry not in self.entries:
            raise InputError(f"unknown entry point {entry!r}; {self.name} has {sorted(self.entries)}")
        plan = self.plans.current.get(entry)
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
        if not plan.input_check:
            plan.input_check = tuple((name, np.dtype(to_numpy(t.dtype)), plan.shapes[name])
                                     for name, t in plan.graph.inputs.items())
        return plan

    def _describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "entries": {}, "persistent_bytes": self.persistent_bytes(),
                               "workspace_bytes": {d: self.workspace.nbytes(d) for d in self.devices}}
        for entry, plan in self.plans.current.items():
            info = plan.schedule.summary()
            info["shapes"] = {k: list(v) for k, v in plan.shapes.items()}
            info["nodes"] = len(plan.graph.nodes)
            info["arena"] = {d: {"planned": p.total, "lower_bound": p.lower_bound, "naive": p.naive,
                                 "chunks": p.chunks, "inplace": p.inplace} for d, p in plan.device_plans.items()}
            fused = {f.node: f for f in plan.graph.fusions}
            info["split_list"] = [{"device": s.device, "nodes": len(s.nodes), "host": s.host,
                                   "node_names": [_node_label(n, fused) for n in s.nodes],
                                   "copies": [f"{c.src.name} {c.src_device}->{c.dst_device} ({c.nbytes} B)" for c in s.copies],
                                   **(prog.describe() if prog is not None else {})}
                                  for s, prog in zip(plan.schedule.splits, plan.programs or [None] * len(plan.schedule.splits))]
            info["fusions"] = [str(f) for f in plan.graph.fusions]
            info["placement_fallbacks"] = [str(f) for f in plan.schedule.fallbacks]
            # prepare time, and per split what the backend says its compile cost (Vulkan:
            # pipelines built, primed, from the pipeline cache, seconds)
            info["prepare_s"] = round(plan.prepare_s, 4)
            out["entries"][entry] = info
        return out


def _uses(devices: Sequence[Any]) -> contextlib.AbstractContextManager:
    """A use of every device (`Device.in_use`) for the block; with one device, its own."""
    if len(devices) == 1:
        return devices[0].in_use()
    stack = contextlib.ExitStack()
    try:
        for dev in devices:
            stack.enter_context(dev.in_use())
    except BaseException:
        stack.close()
        raise
    return stack


def _node_label(node: Tensor, fused: Mapping[str, Any]) -> str:
    """A node's name for describe(): a fused node (named after its chain's first node) also
    lists the nodes it replaced, `name (linear: a + b + c)`."""
    f = fused.get(node.name)
    if f is not None and OPS[node.op].fused:
        return f"{node.name} ({f.op}: {' + '.join(f.replaced)})"
    return node.name


def _release_resources(plans: PlanCache, persistent: PersistentStore, workspace: GraphWorkspace) -> None:
    """Captures, then persistent buffers, then the workspace reference; reports the first failure.

    Module-level (and holding the parts, not the graph) so the finalizer of a
    dropped graph can run it without keeping the graph alive."""
    first_error: BaseException | None = None
    for step in (plans.release, persistent.release):     # 1. captures, 2. persistent buffers
        try:
            step()
        except BaseException as exc:  # keep releasing; report the first failure
            first_error = first_error or exc
    workspace.detach()                                    # 3. the workspace reference
    if first_error is not None:
        raise first_error


def _release_dropped(name: str, plans: PlanCache, persistent: PersistentStore, workspace: GraphWorkspace) -> None:
    """Finalizer of a PreparedGraph garbage-collected without release()."""
    warnings.warn(f"prepared graph {name!r} was dropped without release(); releasing its {persistent.held()} "
                  f"persistent buffer(s) and captures now", ResourceWarning, stacklevel=2)
    _release_resources(plans, persistent, workspace)
