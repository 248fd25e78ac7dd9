"""Binding a plan to memory: every tensor a split touches gets a `Binding`, then each
device compiles (or re-binds) its splits.

A tensor's bytes are in one of three places: a persistent buffer (weights,
state, inputs: `PersistentStore`), the workspace arena of its device (at the
planner's chunk and offset), or — for a tensor another device produced — the
arena slot of its copy on this split's device. `CopyStep`s move those copies
before a split runs, through `host_view` where both sides allow it and through
`read_into`/`write` (staged) otherwise.

`bind` makes a plan runnable against current memory, as one transaction:
persistent buffers it lacks, workspace growth, bindings and captures; on any
failure everything it took is released and the workspace stays as it was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .backend import Binding, Buffer, Device, PreparedSplit, SplitProgram
from .dtypes import to_numpy
from .graph import Tensor
from .host_calls import HostStep
from .partition import Copy
from .persistent import PersistentStore
from .planning import EntryPlan
from .workspace import GraphWorkspace, Growth


@dataclass
class CopyStep:
    """One copy of a tensor's storage between devices, run before its split."""

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


def bind(plan: EntryPlan, devices: Mapping[str, Device], workspace: GraphWorkspace, store: PersistentStore,
         tuning: Mapping[str, str], fresh: bool = False, host_calls: Any = None) -> bool:
    """Make `plan` runnable against current memory; False (nothing done) when already bound.

    `tuning`: "BACKEND.op" -> kernel variant for this plan's entry; `host_calls`: (callbacks, ctx)
    for host nodes compiled inside a device's split (`SplitProgram.host_calls`)."""
    if (not fresh and plan.programs and plan.generation == workspace.generation
            and plan.persist_generation == store.generation):
        return False
    old_programs, plan.programs = plan.programs, []
    new_buffers: list[Buffer] = []
    retired: list[tuple[tuple[str, str], Buffer]] = []
    growth: Growth | None = None
    programs: list[PreparedSplit | None] = []
    try:
        grew = store.reserve(plan.graph, plan.schedule.device_of, devices, new_buffers, retired)
        growth = workspace.grow({devices[d]: chunks for d, chunks in plan.chunks().items()})
        make_bindings(plan, growth, store, devices)
        for split in plan.schedule.splits:
            old = old_programs[split.index] if old_programs else None
            if split.host:
                programs.append(None)
                continue
            dev = devices[split.device]
            program = SplitProgram(dev, split.nodes, plan.split_bindings[split.index], tuning_for(tuning, dev),
                                   host_calls)
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
        store.forget(new_buffers, retired)
        raise
    growth.commit()
    store.commit(retired, grew)
    plan.programs = programs
    plan.generation = workspace.generation
    plan.persist_generation = store.generation
    return True


def tuning_for(tuning: Mapping[str, str], dev: Device) -> dict[str, str]:
    """{"op": variant} of `dev`'s backend out of an entry's {"BACKEND.op": variant}."""
    prefix = f"{dev.backend}."
    return {k[len(prefix):]: v for k, v in tuning.items() if k.startswith(prefix)}


def _bind_tensor(t: Tensor, buf: Buffer, base: int) -> Binding:
    return Binding(buf, base + t.offset * np.dtype(to_numpy(t.dtype)).itemsize, t.shape, t.strides, t.dtype)


def _home(plan: EntryPlan, growth: Growth, store: PersistentStore, storage: Tensor) -> tuple[Buffer, int]:
    dev = plan.schedule.device_of[storage.id]
    if storage.op is None:
        return store.home(storage, dev), 0
    p = plan.device_plans[dev].placements[storage.id]
    return growth.chunk(dev, p.chunk), p.offset


def make_bindings(plan: EntryPlan, growth: Growth, store: PersistentStore, devices: Mapping[str, Device]) -> None:
    """Fill the plan's split bindings, copy steps, input and output bindings."""
    sched = plan.schedule
    plan.split_bindings, plan.copy_steps = [], []
    for split in sched.splits:
        bindings: dict[int, Binding] = {}
        steps: list[CopyStep] = []
        for c in split.copies:
            dst_p = plan.device_plans[split.device].placements[c.key]
            src_buf, src_off = _home(plan, growth, store, c.src)
            dst_buf = growth.chunk(split.device, dst_p.chunk)
            full = Tensor(c.src.id, c.src.name, c.src.shape, c.src.dtype)
            steps.append(CopyStep(c, devices[c.src_device], _bind_tensor(full, src_buf, src_off),
                                  devices[split.device], _bind_tensor(full, dst_buf, dst_p.offset)))
        for node in split.nodes:
            for t in (node, *node.srcs):
                st = t.storage
                copy = split.copy_of(st)
                if copy is not None:
                    p = plan.device_plans[split.device].placements[copy.key]
                    buf, base = growth.chunk(split.device, p.chunk), p.offset
                else:
                    buf, base = _home(plan, growth, store, st)
                bindings[t.id] = _bind_tensor(t, buf, base)
        plan.split_bindings.append(bindings)
        plan.copy_steps.append(steps)
    plan.inputs = {}
    for name, t in plan.graph.inputs.items():
        dev = sched.device_of[t.id]
        plan.inputs[name] = (devices[dev], _bind_tensor(t, store.inputs[(name, dev)], 0))
    # execute writes inputs every step: on a CPU device (host memory, written synchronously)
    # straight into a view resolved here, elsewhere through device.write
    plan.input_writes = [(name, dev, b, dev.host_view(b) if dev.backend == "cpu" else None)
                         for name, (dev, b) in plan.inputs.items()]
    plan.host_steps = {split.index: HostStep(split, plan.split_bindings[split.index],
                                             devices[split.device])
                       for split in sched.splits if split.host}
    plan.outputs = {}
    for name, t in plan.graph.outputs.items():
        buf, base = _home(plan, growth, store, t.storage)
        plan.outputs[name] = (devices[sched.device_of[t.storage.id]], _bind_tensor(t, buf, base))
    plan.output_reads = [(name, dev, b, dev.host_view(b) if dev.backend == "cpu" else None)
                         for name, (dev, b) in plan.outputs.items()]
