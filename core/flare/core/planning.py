"""Planning an entry point: build its graph, place it, fuse, plan its arenas — one path.

`plan_entry` is the only way a PreparedGraph turns (entry builder, input shapes)
into a schedule and arena plans: `prepare` binds and compiles its result,
`reserve` (the dry run) returns its chunk sizes, so the two cannot disagree.
The steps: build and validate the graph; schedule it over the devices with the
persistent tensors pinned where they already live; merge fusable chains where
every node of one sits on a device that supports the fused op, then schedule
again with each fused node pinned where its chain was; plan one arena per device.

`PlanCache` keeps the plans of each entry per input shapes (least recently used
dropped first, its captures released) and which one is current.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from .backend import Binding, Device, PreparedSplit
from .fusion import fuse, fusion_enabled
from .graph import Graph, GraphBuilder, Tensor
from .ops import OPS
from .partition import PlacementFn, Schedule, schedule
from .planner import DevicePlan, plan_schedule

if TYPE_CHECKING:
    from .bindings import CopyStep
    from .host_calls import HostStep

EntryBuilder = Callable[[GraphBuilder, Mapping[str, tuple]], None]
MAX_PLANS_PER_ENTRY = 8


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
    copy_steps: list[list["CopyStep"]] = field(default_factory=list)
    inputs: dict[str, tuple[Device, Binding]] = field(default_factory=dict)
    outputs: dict[str, tuple[Device, Binding]] = field(default_factory=dict)
    prepare_s: float = 0.0  # wall seconds of the prepare that built this plan (graph, plan, memory, compile)
    # (name, NumPy dtype, shape) of every input: execute's check that a call matches this plan
    # exactly (the common case: the same shapes every step) before it looks any further
    input_check: tuple[tuple[str, Any, tuple], ...] = ()
    # per input: (name, device, binding, the host view execute copies into or None: device.write)
    input_writes: list[tuple[str, Device, Binding, Any]] = field(default_factory=list)
    output_reads: list[tuple[str, Device, Binding, Any]] = field(default_factory=list)   # the same for outputs
    host_steps: dict[int, "HostStep"] = field(default_factory=dict)   # split index -> its host node

    def chunks(self) -> dict[str, list[int]]:
        """Arena chunk sizes per device this plan needs (devices needing none left out)."""
        return {d: list(p.chunks) for d, p in self.device_plans.items() if p.chunks}

    def release_captures(self) -> None:
        for prog in self.programs:
            if prog is not None:
                prog.release()
        self.programs = []
        self.generation = -1


def plan_entry(entry: str, builder: EntryBuilder, shapes: Mapping[str, tuple], devices: Mapping[str, Device],
               placement: PlacementFn | None, pinned: Mapping[str, str], strict: bool,
               in_walk: Callable[[Tensor, str], bool] | None = None) -> EntryPlan:
    """Build, validate, schedule, fuse and plan `entry` for `shapes` (nothing allocated)."""
    b = GraphBuilder()
    builder(b, shapes)
    graph = b.build()
    graph.validate(rules=False)  # the builder checked each op's rule as it made it
    order = list(devices.values())
    sched = schedule(graph, order, placement, pinned, strict, in_walk)
    if fusion_enabled():
        sched = _fuse(graph, sched, devices, placement, dict(pinned), strict, in_walk)
    return EntryPlan(entry, dict(shapes), graph, sched, plan_schedule(sched, devices))


def _fuse(graph: Graph, sched: Schedule, devices: Mapping[str, Device], placement: PlacementFn | None,
          pinned: dict[str, str], strict: bool, in_walk: Callable[[Tensor, str], bool] | None = None) -> Schedule:
    """Merge chains that sit on one device supporting the fused op (flare.core.fusion), then
    partition the rewritten graph with each fused node pinned where its chain was."""
    where = sched.device_of

    def accept(candidate: Tensor, chain: list[Tensor]) -> bool:
        devs = {where.get(t.id) for t in chain}
        return len(devs) == 1 and None not in devs and devices[devs.pop()].supports(candidate)

    graph.fusions = fuse(graph, accept)
    if not graph.fusions:
        return sched
    pins = {**pinned, **{t.name: where[t.id] for t in graph.nodes if t.id in where and OPS[t.op].fused}}
    return schedule(graph, list(devices.values()), placement, pins, strict, in_walk)


class PlanCache:
    """Plans per entry and input shapes, least recently used dropped first; the current plan
    of each entry. Guarded by the owning PreparedGraph's lock."""

    def __init__(self, entries: Any, max_plans: int = MAX_PLANS_PER_ENTRY):
        self.plans: dict[str, OrderedDict[tuple, EntryPlan]] = {e: OrderedDict() for e in entries}
        self.current: dict[str, EntryPlan] = {}
        # plans kept per entry; a model whose shapes vary more (exact sequence lengths) may
        # raise it: a plan is host objects, its arena is the workspace's
        self.max_plans = max_plans

    @staticmethod
    def key(shapes: Mapping[str, tuple]) -> tuple:
        return tuple(sorted(shapes.items()))

    def get(self, entry: str, shapes: Mapping[str, tuple]) -> EntryPlan | None:
        cache = self.plans[entry]
        plan = cache.get(self.key(shapes))
        if plan is not None:
            cache.move_to_end(self.key(shapes))
        return plan

    def put(self, plan: EntryPlan) -> None:
        """Cache `plan` as its entry's current one; evicted plans release their captures."""
        cache = self.plans[plan.entry]
        cache[self.key(plan.shapes)] = plan
        while len(cache) > self.max_plans:
            _, old = cache.popitem(last=False)
            old.release_captures()
        self.current[plan.entry] = plan

    def all(self) -> Iterator[EntryPlan]:
        for cache in self.plans.values():
            yield from cache.values()

    def release(self) -> None:
        """Release every plan's captures (each is tried; the first failure is raised after)."""
        first_error: BaseException | None = None
        for cache in self.plans.values():
            for plan in cache.values():
                try:
                    plan.release_captures()
                except BaseException as exc:
                    first_error = first_error or exc
            cache.clear()
        self.current.clear()
        if first_error is not None:
            raise first_error
