"""The persistent buffers of one prepared graph: weights, state and cache, input buffers.

They outlive every plan of the graph (the workspace holds the rest):

- weights are uploaded once per (name, device) and shared by every entry point
  and plan that reads them;
- state and cache tensors are shared by name across entry points (`prefill` and
  `decode` see one KV cache) and must be declared alike by each;
- input buffers are kept per (name, device) and grown to the largest shape
  asked for; a grown buffer bumps `generation`, so plans bound to the old one
  re-bind.

`reserve` is transactional together with the caller: it reports what it
allocated (`new`) and replaced (`retired`), the caller either `commit`s or
`forget`s them. Not thread-safe on its own: the owning PreparedGraph's lock
guards every call.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from .backend import Binding, Buffer, Device
from .dtypes import to_numpy
from .errors import GraphError
from .graph import INPUT, PERSISTENT, WEIGHT, Graph, Tensor


class PersistentStore:
    """Weights, state/cache and input buffers of one graph, by name and device."""

    def __init__(self, owner: str):
        self.owner = owner                                           # ledger tags: OWNER:weight:NAME
        self.weights: dict[tuple[str, str], Buffer] = {}            # (name, device) -> buffer
        self.states: dict[str, tuple[str, Buffer, Tensor]] = {}     # name -> (device, buffer, declaration)
        self.inputs: dict[tuple[str, str], Buffer] = {}             # (name, device) -> buffer
        self.generation = 0                                         # bumped when an input buffer is replaced
        # name -> (whole-tensor host view, elements per row) of state/cache tensors in host memory
        # (CPU devices), resolved on first use by state_rows: their buffers never move once allocated
        self.state_views: dict[str, tuple[np.ndarray, int]] = {}

    def pins(self) -> dict[str, str]:
        """Where existing weights and state live (tensor name -> device): a new plan must
        schedule them there, or it would read a copy that nobody writes."""
        pinned = {name: dev for name, (dev, _, _) in self.states.items()}
        pinned.update({name: dev for (name, dev) in self.weights})
        return pinned

    def reserve(self, graph: Graph, device_of: Mapping[int, str], devices: Mapping[str, Device],
                new: list[Buffer], retired: list[tuple[tuple[str, str], Buffer]]) -> bool:
        """Allocate what `graph`'s leaves still lack; True if an input buffer was replaced.
        Appends what it allocates to `new` and replaced input buffers to `retired`."""
        grew = False
        for t in graph.tensors:
            if t.op is not None:
                continue
            dev_name = device_of[t.id]
            dev = devices[dev_name]
            if t.role == WEIGHT:
                if (t.name, dev_name) not in self.weights:
                    data = np.ascontiguousarray(t.host_data())
                    if data.shape != t.shape or data.dtype != to_numpy(t.dtype):
                        raise GraphError(f"weight data is {data.shape} {data.dtype}, declared {t.shape} {t.dtype}", t.name)
                    tag = f"{self.owner}:weight:{t.name}"
                    # read-only data (a mapped file) on a device that computes on host memory:
                    # used where it lies, no copy (Device.adopt)
                    buf = None if data.flags.writeable else dev.adopt(data, tag=tag)
                    if buf is None:
                        buf = dev.alloc(t.nbytes, tag=tag)
                        dev.write(Binding(buf, 0, t.shape, t.strides, t.dtype), data)
                    new.append(buf)
                    self.weights[(t.name, dev_name)] = buf
            elif t.role in PERSISTENT:
                have = self.states.get(t.name)
                if have is None:
                    buf = dev.alloc(t.nbytes, tag=f"{self.owner}:{t.role}:{t.name}")
                    new.append(buf)
                    self.states[t.name] = (dev_name, buf, t)
                    dev.fill_zero(Binding(buf, 0, t.shape, t.strides, t.dtype))
                elif have[2].shape != t.shape or have[2].dtype != t.dtype or have[0] != dev_name:
                    raise GraphError(f"{t.role} declared as {t.shape} {t.dtype} on {dev_name}, but an earlier entry "
                                     f"declared {have[2].shape} {have[2].dtype} on {have[0]}", t.name)
            elif t.role == INPUT:
                key = (t.name, dev_name)
                old = self.inputs.get(key)
                if old is None or old.nbytes < t.nbytes:
                    # a grown input buffer moves every plan of the graph to re-bind: a regrowth
                    # takes twice the old size, so inputs growing a little each call (a plan per
                    # length) re-bind a few times, not once per new maximum
                    size = t.nbytes if old is None else max(t.nbytes, min(2 * old.nbytes, dev.buffer_type().max_size))
                    buf = dev.alloc(size, tag=f"{self.owner}:input:{t.name}")
                    new.append(buf)
                    self.inputs[key] = buf
                    if old is not None:
                        retired.append((key, old))
                        grew = True
        return grew

    def commit(self, retired: list[tuple[tuple[str, str], Buffer]], grew: bool) -> None:
        """The attempt succeeded: free the replaced input buffers."""
        for _, buf in retired:
            buf.release()
        if grew:
            self.generation += 1

    def forget(self, new: list[Buffer], retired: list[tuple[tuple[str, str], Buffer]]) -> None:
        """Undo a failed attempt: free what it allocated, restore the input buffers it replaced."""
        ids = {id(b) for b in new}
        for key in [k for k, b in self.weights.items() if id(b) in ids]:
            del self.weights[key]
        for key in [k for k, v in self.states.items() if id(v[1]) in ids]:
            del self.states[key]
            self.state_views.pop(key, None)
        for key in [k for k, b in self.inputs.items() if id(b) in ids]:
            del self.inputs[key]
        for buf in new:
            buf.release()
        for key, buf in retired:
            self.inputs[key] = buf
        retired.clear()

    def home(self, storage: Tensor, device: str) -> Buffer:
        """The buffer of a leaf (weight, input, state) on `device`."""
        if storage.role == WEIGHT:
            return self.weights[(storage.name, device)]
        if storage.role == INPUT:
            return self.inputs[(storage.name, device)]
        return self.states[storage.name][1]

    def nbytes(self) -> dict[str, int]:
        """Persistent bytes per device."""
        per: dict[str, int] = {}
        for (_, dev), buf in list(self.weights.items()) + list(self.inputs.items()):
            per[dev] = per.get(dev, 0) + buf.nbytes
        for dev, buf, _ in self.states.values():
            per[dev] = per.get(dev, 0) + buf.nbytes
        return per

    def held(self) -> int:
        return len(self.inputs) + len(self.states) + len(self.weights)

    def release(self) -> None:
        """Free every buffer (inputs, state, weights); every one is tried, the first failure raised."""
        first_error: BaseException | None = None
        for buf in list(self.inputs.values()) + [b for _, b, _ in self.states.values()] + list(self.weights.values()):
            try:
                buf.release()
            except BaseException as exc:
                first_error = first_error or exc
        self.state_views.clear()
        self.inputs.clear()
        self.states.clear()
        self.weights.clear()
        if first_error is not None:
            raise first_error
