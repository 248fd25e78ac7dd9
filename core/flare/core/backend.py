"""What a backend is, in ggml-backend's layers: backend -> device -> buffer type -> buffer.

A backend plugin returns a `BackendSpec` whose `backend` class can `probe()`
(is it usable here, and if not, why) and open its `Device`s. A device owns
memory (`alloc` through the ledger), moves bytes (`write`, `read_into`,
`host_view`), says which nodes it `supports`, and turns a split of the graph
into a `PreparedSplit` (its captured program: bound closures on the CPU, a
recorded command buffer on Vulkan, a CUDA graph on CUDA) that `run()` replays.
"""
from __future__ import annotations

import abc
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np

from .dtypes import to_numpy
from .errors import AllocationError, ReleasedError
from .graph import Tensor
from .ledger import LEDGER


@dataclass(frozen=True)
class BufferType:
    """How a device's memory may be carved: alignment of offsets, largest single buffer."""

    name: str
    alignment: int
    max_size: int


@dataclass(frozen=True)
class MemoryInfo:
    free: int
    total: int


@dataclass(frozen=True)
class ProbeResult:
    """Whether a backend can run here; `reason` says why not (or what it found)."""

    usable: bool
    reason: str
    devices: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)


class Buffer:
    """One device allocation, recorded in the ledger, freed exactly once."""

    def __init__(self, device: "Device", nbytes: int, handle: Any, tag: str):
        self.device = device
        self.nbytes = int(nbytes)
        self.handle = handle
        self.tag = tag
        self._ledger_id = LEDGER.record_alloc(device.name, self.nbytes, tag)

    @property
    def released(self) -> bool:
        return self._ledger_id is None

    def release(self) -> None:
        """Free the memory; a second call does nothing."""
        if self._ledger_id is None:
            return
        lid, self._ledger_id = self._ledger_id, None
        try:
            self.device._free_raw(self.handle)
        finally:
            self.handle = None
            LEDGER.record_free(lid)

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.nbytes} B"
        return f"Buffer({self.device.name}, {self.tag}, {state})"


@dataclass(frozen=True)
class Binding:
    """Where a tensor lives on a device: buffer, byte offset, shape, element strides, dtype."""

    buffer: Buffer
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return to_numpy(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        from .graph import contiguous_strides

        return tuple(self.strides) == contiguous_strides(self.shape)


@dataclass
class SplitProgram:
    """A run of consecutive nodes assigned to one device, with every tensor they touch bound."""

    device: "Device"
    nodes: list[Tensor]
    bindings: dict[int, Binding]  # tensor id -> binding (srcs and outputs of `nodes`)
    tuning: Mapping[str, str] = field(default_factory=dict)  # op -> kernel variant to use

    def binding(self, tensor: Tensor) -> Binding:
        return self.bindings[tensor.id]


class PreparedSplit(abc.ABC):
    """A device's captured program for one split. `run` replays it to completion."""

    @abc.abstractmethod
    def run(self) -> None: ...

    @abc.abstractmethod
    def release(self) -> None:
        """Destroy captures (command buffers, CUDA graphs); idempotent."""

    def describe(self) -> dict[str, Any]:
        """What the capture is made of (executor, nodes run natively...), for PreparedGraph.describe."""
        return {}

    def rebind(self, program: "SplitProgram") -> bool:
        """Point the capture at new bindings of the *same* nodes (workspace growth,
        grown inputs) without re-capturing. Return False when that is not possible;
        the caller then releases this split and compiles `program` anew."""
        return False


class _InUse:
    """`Device.in_use()`'s context manager: one user of `device` while the block runs."""

    __slots__ = ("_device",)

    def __init__(self, device: "Device"):
        self._device = device

    def __enter__(self) -> "Device":
        dev = self._device
        with dev._use_cond:
            if dev.closed or dev._closing:
                raise ReleasedError(f"device {dev.name} is closed")
            dev._users += 1
        return dev

    def __exit__(self, *exc: Any) -> None:
        dev = self._device
        with dev._use_cond:
            dev._users -= 1
            if dev._users == 0:
                dev._use_cond.notify_all()


class Device(abc.ABC):
    """One device of a backend. Subclasses implement the `_raw` hooks and `compile`.

    Thread safety: a device may be used by several prepared graphs at the same
    time (each backend serialises its own queue). `in_use()` marks one user's
    work in flight; `close()` first refuses new users, then waits for those in
    flight (`_begin_close`), so a device closed under live graphs never frees
    memory a running execute touches, and later executes raise ReleasedError.
    """

    backend: ClassVar[str] = "?"

    # No per-device priority: the scheduler prefers devices in the order the session was
    # given them (`Session(["vulkan", "cpu"])`); `BackendSpec.priority` only orders listings.
    def __init__(self, name: str):
        self.name = name
        self.closed = False
        self._closing = False
        self._users = 0
        self._use_cond = threading.Condition()

    # -- users and closing ------------------------------------------------------
    def in_use(self) -> contextlib.AbstractContextManager["Device"]:
        """Hold the device open for the block; ReleasedError if it is closed or closing.

        A small class, not a generator context manager: every execute enters one (a moe-lm
        decode step is ~55 us in all), and the generator form cost ~2.5 us of it, this ~0.6."""
        return _InUse(self)

    def _begin_close(self) -> bool:
        """Refuse new users and wait for those in flight. False when a close already began
        (the caller then returns: close is idempotent)."""
        with self._use_cond:
            if self._closing:
                return False
            self._closing = True
            while self._users:
                self._use_cond.wait()
        return True

    # -- memory -------------------------------------------------------------
    @abc.abstractmethod
    def buffer_type(self) -> BufferType: ...

    @abc.abstractmethod
    def memory(self) -> MemoryInfo: ...

    def alloc(self, nbytes: int, tag: str = "") -> Buffer:
        """Allocate through the ledger. Raises AllocationError (never returns a null buffer)."""
        return self._alloc_through_ledger(nbytes, tag, self._alloc_raw)

    def _alloc_through_ledger(self, nbytes: int, tag: str, raw: Callable[[int], Any]) -> Buffer:
        """`alloc`'s checks and ledger entry around `raw(nbytes)`: a backend with a second kind of
        memory for some buffers (the CPU's packed weights in huge pages) passes its own `raw`."""
        if self.closed:
            raise ReleasedError(f"device {self.name} is closed")
        nbytes = int(nbytes)
        bt = self.buffer_type()
        free = self.memory().free
        if nbytes > bt.max_size:
            raise AllocationError(self.name, nbytes, free, f"larger than the largest buffer of {bt.name}: {bt.max_size} bytes")
        LEDGER.admit(self.name, nbytes, free)
        handle = raw(max(nbytes, 1))  # raises AllocationError on device OOM
        return Buffer(self, nbytes, handle, tag)

    def adopt(self, array: np.ndarray, tag: str = "") -> Buffer | None:
        """A buffer that *is* `array`'s memory, for a read-only weight (a view of a memory-mapped
        file: GGUF), where this device computes on host memory as it lies; None where it cannot
        (the caller allocates and copies). Why: a copy doubles the weights' resident memory
        while it is made and keeps a second copy of the file's pages after. The buffer keeps a
        reference to `array`; releasing it drops the reference. Recorded in the ledger."""
        return None

    @abc.abstractmethod
    def _alloc_raw(self, nbytes: int) -> Any:
        """Allocate device memory; raise AllocationError if the device refuses."""

    @abc.abstractmethod
    def _free_raw(self, handle: Any) -> None: ...

    # -- bytes in and out -----------------------------------------------------
    def host_view(self, binding: Binding) -> np.ndarray | None:
        """A NumPy view of the tensor's memory if the host can address it directly."""
        return None

    @abc.abstractmethod
    def write(self, binding: Binding, array: np.ndarray) -> None:
        """Copy a host array (already of the binding's dtype and shape) into device memory."""

    @abc.abstractmethod
    def read_into(self, binding: Binding, out: np.ndarray) -> None:
        """Copy the tensor's bytes into the host array `out` (same shape and dtype)."""

    def read(self, binding: Binding) -> np.ndarray:
        out = np.empty(binding.shape, to_numpy(binding.dtype))
        self.read_into(binding, out)
        return out

    def fill_zero(self, binding: Binding) -> None:
        """Zero a tensor (state reset). Devices with a native fill override this."""
        self.write(binding, np.zeros(binding.shape, to_numpy(binding.dtype)))

    # -- compute -------------------------------------------------------------
    @abc.abstractmethod
    def supports(self, node: Tensor) -> bool:
        """Whether `compile` can run this node (op, dtypes, shapes)."""

    def kernel_variants(self, op: str) -> tuple[str, ...]:
        """Names of this device's interchangeable implementations of `op` (same results up to
        rounding), the first being the default. `SplitProgram.tuning[op]` picks one; an
        exporter times them (`flare.plugins.export.tuning`). Default: one implementation."""
        return ()

    @abc.abstractmethod
    def compile(self, program: SplitProgram) -> PreparedSplit:
        """Build the split's captured program against its bindings."""

    def synchronize(self) -> None:
        """Wait for queued work (a no-op for synchronous devices)."""

    def live_objects(self) -> dict[str, int]:
        """Counts of live per-graph backend objects (command buffers, descriptor pools, CUDA
        graphs...): back to their starting values after release, which leak tests assert."""
        return {}

    def cache_objects(self) -> dict[str, int]:
        """Counts of device-lifetime caches (pipelines, loaded modules, staging buffers):
        kept across graphs on purpose and freed by close()."""
        return {}

    def describe(self) -> dict[str, Any]:
        mem = self.memory()
        bt = self.buffer_type()
        return {"name": self.name, "free": mem.free, "total": mem.total,
                "alignment": bt.alignment, "max_buffer": bt.max_size}

    def close(self) -> None:
        """Release device-level objects (after the work in flight); buffers should already be released."""
        if self._begin_close():
            self.closed = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class Backend(abc.ABC):
    """A kind of device. Class-level: probing must not require opening anything."""

    name: ClassVar[str] = "?"

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> ProbeResult:
        """Say whether this backend can run here, and if not, exactly why."""

    @classmethod
    @abc.abstractmethod
    def open_devices(cls, config: Mapping[str, Any] | None = None) -> list[Device]:
        """Open the devices this backend offers (raises BackendUnavailable with the reason)."""


def numpy_view(raw: np.ndarray, binding: Binding) -> np.ndarray:
    """A strided NumPy view of `binding` inside a host-addressable uint8 array `raw`."""
    item = binding.itemsize
    span = 1 + sum((d - 1) * s for d, s in zip(binding.shape, binding.strides)) if all(binding.shape) else 0
    base = raw[binding.offset: binding.offset + span * item].view(to_numpy(binding.dtype))
    return np.lib.stride_tricks.as_strided(
        base, shape=binding.shape, strides=tuple(s * item for s in binding.strides), writeable=True
    )
