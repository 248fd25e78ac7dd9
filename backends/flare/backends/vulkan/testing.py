"""Binding a graph into device memory by hand, without the planner: for backend tests and benchmarks.

Every storage tensor gets its own region of ONE arena buffer, at offsets aligned to the
device's buffer-type alignment (plus optional extra gaps), and every view gets a binding
that aliases its storage, as the planner would bind them. Putting all tensors in one
VkBuffer is deliberate: the split's barrier logic then has to tell regions apart, which
it must do for the planner's arenas too.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import numpy as np

from flare.core.backend import Binding, Buffer, Device, PreparedSplit, SplitProgram
from flare.core.dtypes import to_numpy
from flare.core.graph import Graph


class HandBound:
    """`graph` bound into one arena on `device`; all nodes form one split."""

    def __init__(self, device: Device, graph: Graph, *, gap: int = 0,
                 alias: Mapping[str, str] | None = None, tag: str = "test-arena"):
        """`gap`: extra alignment units between tensors; `alias`: node name -> name of the
        tensor whose memory it reuses (to test in-place execution as the planner does it)."""
        self.device = device
        self.graph = graph
        align = device.buffer_type().alignment
        by_name = {t.name: t for t in graph.tensors}
        alias = dict(alias or {})
        self.offsets: dict[int, int] = {}
        cursor = 0
        for t in graph.tensors:
            if t.storage is not t or t.name in alias:
                continue
            self.offsets[t.id] = cursor
            cursor += -(-max(t.nbytes, 1) // align) * align + gap * align
        for name, target in alias.items():
            self.offsets[by_name[name].id] = self.offsets[by_name[target].id]
        self.buffer: Buffer = device.alloc(max(cursor, align), tag=tag)
        self.bindings: dict[int, Binding] = {}
        for t in graph.tensors:
            s = t.storage
            item = to_numpy(t.dtype).itemsize
            self.bindings[t.id] = Binding(self.buffer, self.offsets[s.id] + t.offset * item, tuple(t.shape),
                                          tuple(t.strides), t.dtype)
        self.split: PreparedSplit | None = None

    def binding(self, name: str) -> Binding:
        return self.bindings[next(t.id for t in self.graph.tensors if t.name == name)]

    def write_leaves(self, inputs: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray] | None = None) -> None:
        """Inputs from `inputs`, weights from their data, states from `states` (else zero)."""
        states = dict(states or {})
        for t in self.graph.tensors:
            if t.op is not None:
                continue
            if t.role == "input":
                self.device.write(self.bindings[t.id], np.asarray(inputs[t.name]))
            elif t.role == "weight":
                self.device.write(self.bindings[t.id], t.host_data())
            else:
                self.device.write(self.bindings[t.id], states.get(t.name, np.zeros(t.shape, to_numpy(t.dtype))))

    def compile(self) -> PreparedSplit:
        if self.split is not None:
            self.split.release()
        self.split = self.device.compile(SplitProgram(self.device, self.graph.nodes, self.bindings))
        return self.split

    def run(self, inputs: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Write leaves, (compile once), run, read every graph output."""
        self.write_leaves(inputs, states)
        if self.split is None:
            self.compile()
        self.split.run()
        return self.outputs()

    def outputs(self) -> dict[str, np.ndarray]:
        return {name: self.device.read(self.bindings[t.id]) for name, t in self.graph.outputs.items()}

    def read(self, name: str) -> np.ndarray:
        return self.device.read(self.binding(name))

    def release(self) -> None:
        if self.split is not None:
            self.split.release()
            self.split = None
        self.buffer.release()

    def __enter__(self) -> "HandBound":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


MEMORY_KINDS = ("mapped", "staged")


def memory_kind_device(request: Any) -> Iterator[Device]:
    """Body of a pytest fixture parametrized over `MEMORY_KINDS`: the first Vulkan device with
    host-mapped memory (lavapipe's default) or with forced staging (device memory the host
    cannot see, as on a discrete GPU); closed after the module.

        dev = pytest.fixture(scope="module", params=MEMORY_KINDS)(memory_kind_device)
    """
    from .backend import VulkanBackend

    (device,) = VulkanBackend.open_devices({"force_staging": request.param == "staged"})
    try:
        assert device.mapped == (request.param == "mapped")
        yield device
    finally:
        device.close()
