"""The scheduler: one graph over several devices (ggml's backend scheduler, simplified).

Rules, in order, for each op node:
1. the model's placement callback (or a pinned placement) decides if it answers
   with a device name; an answer wrapped in `Prefer(name)` is only a wish: when
   that device cannot run the node (its `supports` says no, or the state it writes
   lives elsewhere) the rules below decide, and the schedule records the fallback
   (`Schedule.fallbacks`, `describe()["entries"][e]["placement_fallbacks"]`);
2. a write into state (`set_rows`, `copy_into`) runs where that state lives;
3. weights follow: a node reading a weight goes to the weight's device if that
   device supports it;
4. otherwise the first device (in the session's order) that supports the node.
In strict mode a node that cannot go to the first device (a silent
fallback) is an error listing every such node. View nodes need no device of
their own: they live where their storage lives. Inputs and state go to the
device of their first real consumer unless placed.

Consecutive nodes on one device form a split; a `host` node is a split of its
own. A tensor read by a split on another device is copied there once per
split (its storage, so views keep their offsets), before the split runs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from .backend import Device
from .errors import PlacementError
from .graph import WEIGHT, Graph, Tensor
from .ops import OPS

_copy_keys = itertools.count(-1, -1)  # copies get negative keys, tensors positive ids


@dataclass(frozen=True)
class Prefer:
    """A placement answer that may be overruled: run on `device` if it can run the node,
    else let the scheduler's other rules choose (and record the fallback)."""

    device: str


class PlacementDevices(list):
    """What a placement callback gets as `devices`: the session's device names in the
    order the user gave (a plain `list[str]`, so `devices[0]` and `devices[-1]` work),
    plus the questions a callback needs to place a node where it can run.

    Read-only use only; one is made per schedule and not shared between threads."""

    def __init__(self, devices: Sequence[Device]):
        super().__init__(d.name for d in devices)
        self._by_name = {d.name: d for d in devices}

    def device(self, name: str) -> Device:
        """The Device behind a name (a backend name means its first device)."""
        dev = self._by_name.get(name) or self._by_name.get(f"{name}:0")
        if dev is None:
            raise PlacementError(f"no device {name!r} in this session ({', '.join(self)})", [name])
        return dev

    def can_run(self, node: Tensor, name: str) -> bool:
        """Whether device `name` supports `node` (True for leaves and views, which run nowhere)."""
        if node.op is None or node.op == "host" or OPS[node.op].view is not None:
            return True
        return self.device(name).supports(node)


PlacementFn = Callable[[Tensor, PlacementDevices], "str | Prefer | None"]


@dataclass(frozen=True)
class Fallback:
    """A node a placement callback preferred on `preferred` that runs on `device` instead."""

    node: str
    op: str
    preferred: str
    device: str
    why: str

    def __str__(self) -> str:
        return f"{self.node} ({self.op}): preferred {self.preferred}, runs on {self.device} ({self.why})"


@dataclass
class Copy:
    """Bring `src` (a storage tensor) from `src_device` to `dst_device` before a split."""

    key: int
    src: Tensor
    src_device: str
    dst_device: str

    @property
    def nbytes(self) -> int:
        return self.src.nbytes


@dataclass
class Split:
    index: int
    device: str
    nodes: list[Tensor]
    host: bool = False
    copies: list[Copy] = field(default_factory=list)

    def copy_of(self, storage: Tensor) -> Copy | None:
        for c in self.copies:
            if c.src.id == storage.id:
                return c
        return None


@dataclass
class Schedule:
    graph: Graph
    splits: list[Split]
    device_of: dict[int, str]          # storage/op tensor id -> device name
    time_of: dict[int, int]            # op node id -> schedule time (odd numbers)
    split_time: dict[int, int]         # split index -> time its copies happen (even)
    fallbacks: list[Fallback] = field(default_factory=list)   # preferences the scheduler overruled

    @property
    def copies(self) -> list[Copy]:
        return [c for s in self.splits for c in s.copies]

    def summary(self) -> dict:
        per_device: dict[str, int] = {}
        for s in self.splits:
            per_device[s.device] = per_device.get(s.device, 0) + 1
        return {
            "splits": len(self.splits),
            "splits_per_device": per_device,
            "copies": len(self.copies),
            "bytes_copied_per_execute": sum(c.nbytes for c in self.copies),
            "host_splits": sum(1 for s in self.splits if s.host),
        }


def schedule(
    graph: Graph,
    devices: Sequence[Device],
    placement: PlacementFn | None = None,
    pinned: Mapping[str, str] | None = None,
    strict: bool = False,
    in_walk: Callable[[Tensor, str], bool] | None = None,
) -> Schedule:
    """Assign every node to a device and cut the graph into splits with copies. `in_walk(node,
    device)`: whether a host node runs inside that device's split (a command of its own there,
    `HostCallback.runs_in_walk`) instead of a host split."""
    if not devices:
        raise PlacementError("no devices to schedule on")
    names = [d.name for d in devices]
    by_name = {d.name: d for d in devices}
    top = devices[0]
    pinned = dict(pinned or {})
    device_of: dict[int, str] = {}
    overruled: list[tuple[Tensor, str, str]] = []   # (node, the device it preferred, why not there)
    offered = PlacementDevices(devices)   # what the callback sees as `devices`

    def ask(t: Tensor) -> str | None:
        """The callback's (or pin's) device for `t`; a Prefer answer is returned only where
        it can be kept (else it is recorded in `overruled` and the other rules decide)."""
        if t.name in pinned:
            return pinned[t.name]
        if placement is None:
            return None
        answer = placement(t, offered)
        prefer = isinstance(answer, Prefer)
        choice = answer.device if prefer else answer
        if choice is not None and choice not in by_name and f"{choice}:0" in by_name:
            choice = f"{choice}:0"  # a backend name means its first device
        if choice is not None and choice not in by_name:
            raise PlacementError(f"placement callback put {t.name!r} on {choice!r}, which is not one of {names}", [t.name])
        if prefer and choice is not None and t.op is not None and t.op != "host":
            why = None
            if not by_name[choice].supports(t):
                why = f"{choice} does not support {t.op}"
            elif OPS[t.op].writes_src0:
                home = device_of.get(t.srcs[0].storage.id)
                if home is not None and home != choice:
                    why = f"the state {t.srcs[0].storage.name!r} it writes lives on {home}"
            if why is not None:
                overruled.append((t, choice, why))
                return None
        return choice

    # weights first: where the callback says, else the best device for their first consumer
    consumers = graph.consumers()
    for w in graph.weights.values():
        d = ask(w)
        if d is None:
            users = [u for u in _real_consumers(w, consumers)]
            d = next((dev.name for dev in devices if users and dev.supports(users[0])), top.name)
        device_of[w.id] = d
    for s in graph.states.values():
        d = ask(s)
        if d is not None:
            device_of[s.id] = d

    fallbacks: list[str] = []
    unplaceable: list[str] = []
    for node in graph.nodes:
        opdef = OPS[node.op]
        if opdef.view is not None:
            continue
        if node.op == "host":
            continue  # placed after its inputs are (below)
        choice = ask(node)
        if choice is not None and opdef.writes_src0:
            home = device_of.get(node.srcs[0].storage.id)
            if home is not None and home != choice:
                # the write would land in a copy of the state and be lost
                raise PlacementError(f"placement put {node.name!r} ({node.op}) on {choice}, but the state "
                                     f"{node.srcs[0].storage.name!r} it writes lives on {home}", [node.name])
            device_of.setdefault(node.srcs[0].storage.id, choice)
        if choice is not None:
            if not by_name[choice].supports(node):
                raise PlacementError(f"placement put {node.name!r} ({node.op}) on {choice}, which does not support it", [node.name])
            device_of[node.id] = choice
            continue
        if opdef.writes_src0:
            dst = node.srcs[0].storage
            if dst.id in device_of:
                if not by_name[device_of[dst.id]].supports(node):
                    unplaceable.append(node.name)
                device_of[node.id] = device_of[dst.id]
                continue
        weight_devs = [device_of[s.storage.id] for s in node.srcs if s.storage.role == WEIGHT]
        chosen = next((d for d in weight_devs if by_name[d].supports(node)), None)
        if chosen is None:
            chosen = next((d.name for d in devices if d.supports(node)), None)
        if chosen is None:
            unplaceable.append(node.name)
            continue
        wanted = weight_devs[0] if weight_devs else top.name
        if chosen != wanted:
            fallbacks.append(f"{node.name} ({node.op})")
        device_of[node.id] = chosen
        if opdef.writes_src0:
            device_of.setdefault(node.srcs[0].storage.id, chosen)
    if unplaceable:
        raise PlacementError(f"no device supports: {', '.join(unplaceable)}", unplaceable)
    preferences = [Fallback(t.name, t.op, want, device_of[t.id], why) for t, want, why in overruled]
    fallbacks = [f for f in fallbacks if f.split(" ")[0] not in {p.node for p in preferences}]
    fallbacks += [str(f) for f in preferences]
    if strict and fallbacks:
        raise PlacementError(
            f"strict placement: {len(fallbacks)} node(s) cannot run on {top.name} and would fall back: "
            + ", ".join(fallbacks), [f.split(" ")[0] for f in fallbacks])

    # host nodes: where their first input lives (else the top device)
    for node in graph.nodes:
        if node.op == "host":
            src_devs = [device_of.get(s.storage.id) for s in node.srcs]
            device_of[node.id] = ask(node) or next((d for d in src_devs if d), top.name)

    # leaves without a device: the device of their first real consumer
    for leaf in graph.tensors:
        if leaf.op is None and leaf.id not in device_of:
            users = _real_consumers(leaf, consumers)
            device_of[leaf.id] = device_of[users[0].id] if users else top.name

    # views live with their storage
    for node in graph.nodes:
        if OPS[node.op].view is not None:
            device_of[node.id] = device_of[node.storage.id]

    sched = _cut(graph, device_of, in_walk)
    sched.fallbacks = preferences
    return sched


def _real_consumers(t: Tensor, consumers: Mapping[int, list[Tensor]]) -> list[Tensor]:
    """Non-view nodes that read `t`, directly or through views, in graph order."""
    out: list[Tensor] = []
    stack = list(consumers.get(t.id, []))
    seen: set[int] = set()
    while stack:
        n = stack.pop(0)
        if n.id in seen:
            continue
        seen.add(n.id)
        if OPS[n.op].view is not None:
            stack.extend(consumers.get(n.id, []))
        else:
            out.append(n)
    return sorted(out, key=lambda n: n.id)


def _cut(graph: Graph, device_of: dict[int, str], in_walk: Callable[[Tensor, str], bool] | None = None) -> Schedule:
    splits: list[Split] = []
    time_of: dict[int, int] = {}
    split_time: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        time_of[node.id] = 2 * i + 1
        if OPS[node.op].view is not None:
            continue
        dev = device_of[node.id]
        is_host = node.op == "host" and not (in_walk is not None and in_walk(node, dev))
        if not splits or splits[-1].device != dev or is_host or splits[-1].host:
            splits.append(Split(len(splits), dev, [], host=is_host))
            split_time[splits[-1].index] = 2 * i
        splits[-1].nodes.append(node)
    for split in splits:
        for node in split.nodes:
            for src in node.srcs:
                st = src.storage
                home = device_of[st.id]
                if home != split.device and split.copy_of(st) is None:
                    split.copies.append(Copy(next(_copy_keys), st, home, split.device))
    return Schedule(graph, splits, device_of, time_of, split_time)
