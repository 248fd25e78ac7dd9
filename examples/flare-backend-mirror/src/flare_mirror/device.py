"""The mirror backend: a device whose memory the host does not address, and an interpreter.

It runs Flare's own CPU kernels, so its results match the CPU's exactly, but
reaches them the way an accelerator backend would:

- memory: each buffer is a `bytearray` with offsets aligned to 256 bytes (a
  GPU's storage-buffer alignment) and at most 256 MiB per buffer, out of a fixed
  device size (1 GiB unless the session's config says `memory`); `host_view`
  says "not host-addressable", so the runtime moves bytes only through
  `write` / `read_into`, as it does for Vulkan and CUDA;
- compile: a split becomes a `MirrorProgram` — a tuple of instructions
  (op, output slot, source slots, params) plus a table of slot views — instead
  of the CPU backend's bound closures; `run()` interprets it;
- rebind: when the workspace grows, only the slot table is rebuilt from the
  new bindings; the instructions stay (what `cuGraphExecUpdate` is to CUDA);
- `live_objects()` counts live programs, so the conformance suite's leak check
  sees a program that release forgot.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from flare.core.backend import (Backend, Binding, BufferType, Device, MemoryInfo, PreparedSplit, ProbeResult,
                           SplitProgram, numpy_view)
from flare.backends.cpu.kernels import KERNELS
from flare.core.errors import AllocationError, BackendUnavailable, ReleasedError
from flare.core.graph import Tensor
from flare.core.ledger import LEDGER
from flare.core.ops import OPS

ALIGNMENT = 256               # byte alignment of every offset the planner hands out
MAX_BUFFER = 256 << 20        # the largest single buffer; larger arenas are planned in chunks
DEFAULT_MEMORY = 1 << 30      # device size unless the session config gives `memory`
DEVICES_ENV = "FLARE_MIRROR_DEVICES"


@dataclass(frozen=True)
class Instruction:
    """One kernel call of a compiled split: `KERNELS[op](slot[out], [slot[s] for s in srcs], params)`."""

    op: str
    out: int
    srcs: tuple[int, ...]
    params: Mapping[str, Any]


class MirrorProgram(PreparedSplit):
    """A compiled split: instructions over numbered slots, and the views the slots point at."""

    def __init__(self, device: "MirrorDevice", program: SplitProgram):
        self._device = device
        self._node_ids = tuple(n.id for n in program.nodes)
        self._slot_of: dict[int, int] = {}          # tensor id -> slot
        code = []
        for node in program.nodes:
            if OPS[node.op].view is not None:
                continue                            # a view aliases its source's bytes: nothing to run
            out = self._slot(node)
            code.append(Instruction(node.op, out, tuple(self._slot(s) for s in node.srcs), dict(node.params)))
        self._code = tuple(code)
        self._views: list[np.ndarray] | None = self._resolve(program)
        device._programs += 1

    def _slot(self, tensor: Tensor) -> int:
        return self._slot_of.setdefault(tensor.id, len(self._slot_of))

    def _resolve(self, program: SplitProgram) -> list[np.ndarray]:
        views: list[np.ndarray] = [None] * len(self._slot_of)  # type: ignore[list-item]
        for tensor_id, slot in self._slot_of.items():
            views[slot] = self._device.private_view(program.bindings[tensor_id])
        return views

    def run(self) -> None:
        views = self._views
        if views is None:
            raise ReleasedError(f"{self._device.name}: this program was released")
        for ins in self._code:
            KERNELS[ins.op](views[ins.out], [views[s] for s in ins.srcs], ins.params)

    def rebind(self, program: SplitProgram) -> bool:
        """Same nodes, new memory: keep the instructions, rebuild the slot table."""
        if self._views is None or tuple(n.id for n in program.nodes) != self._node_ids:
            return False
        self._views = self._resolve(program)
        self._device.stats["rebinds"] += 1
        return True

    def release(self) -> None:
        if self._views is None:
            return
        self._views, self._code = None, ()
        self._device._programs -= 1


class MirrorDevice(Device):
    """One mirror device: private memory, byte moves, and `compile` into a MirrorProgram."""

    backend = "mirror"

    def __init__(self, name: str, memory_bytes: int = DEFAULT_MEMORY):
        super().__init__(name)
        self.total = int(memory_bytes)
        self.stats = {"compiles": 0, "rebinds": 0}
        self._programs = 0

    # -- memory ---------------------------------------------------------------
    def buffer_type(self) -> BufferType:
        return BufferType("mirror", ALIGNMENT, MAX_BUFFER)

    def memory(self) -> MemoryInfo:
        return MemoryInfo(max(0, self.total - LEDGER.live_bytes(self.name)), self.total)

    def _alloc_raw(self, nbytes: int) -> bytearray:
        # Device.alloc has already checked MAX_BUFFER and the ledger's admission (free memory,
        # fault injection); only the host itself can still refuse
        try:
            return bytearray(nbytes)
        except MemoryError:
            raise AllocationError(self.name, nbytes, self.memory().free, "the host refused the buffer") from None

    def _free_raw(self, handle: Any) -> None:
        pass  # the bytearray goes with the Buffer's last reference

    # -- bytes in and out ---------------------------------------------------------
    def private_view(self, binding: Binding) -> np.ndarray:
        """The device's own strided view of a binding (the runtime never sees it)."""
        return numpy_view(np.frombuffer(binding.buffer.handle, np.uint8), binding)

    # host_view() is inherited and returns None: the host does not address mirror memory

    def write(self, binding: Binding, array: np.ndarray) -> None:
        np.copyto(self.private_view(binding), array, casting="same_kind")

    def read_into(self, binding: Binding, out: np.ndarray) -> None:
        np.copyto(out, self.private_view(binding))

    # -- compute ------------------------------------------------------------------
    def supports(self, node: Tensor) -> bool:
        return node.op in KERNELS

    def compile(self, program: SplitProgram) -> MirrorProgram:
        self.stats["compiles"] += 1
        return MirrorProgram(self, program)

    def live_objects(self) -> dict[str, int]:
        return {"programs": self._programs}


def configured_devices() -> int:
    """How many devices FLARE_MIRROR_DEVICES offers (default 2); ValueError saying why not a number."""
    text = os.environ.get(DEVICES_ENV, "2").strip()
    if not text.isdigit():
        raise ValueError(f"{DEVICES_ENV}={text!r} is not a number of devices")
    return int(text)


class MirrorBackend(Backend):
    """The kind of device. Config (Session(config={"mirror": {...}})): `count`, `memory` in bytes."""

    name = "mirror"

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            count = configured_devices()
        except ValueError as exc:
            return ProbeResult(False, str(exc))
        if count == 0:
            return ProbeResult(False, f"{DEVICES_ENV}=0: no mirror devices configured")
        return ProbeResult(True, f"{count} device(s) interpreting Flare's CPU kernels, {ALIGNMENT}-byte alignment",
                           tuple(f"mirror:{i}" for i in range(count)), {"alignment": ALIGNMENT})

    @classmethod
    def open_devices(cls, config: Mapping[str, Any] | None = None) -> list[MirrorDevice]:
        config = dict(config or {})
        probe = cls.probe()
        if not probe.usable:
            raise BackendUnavailable(f"mirror: {probe.reason}")
        count, offered = int(config.get("count", 1)), len(probe.devices)
        if not 1 <= count <= offered:
            raise BackendUnavailable(f"mirror: {count} device(s) asked for, {offered} offered ({DEVICES_ENV})")
        memory = int(config.get("memory", DEFAULT_MEMORY))
        return [MirrorDevice(f"mirror:{i}", memory) for i in range(count)]
