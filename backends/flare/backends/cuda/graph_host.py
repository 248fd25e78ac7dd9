"""What a compiled CUDA split may ask of its device: `GraphHost`, and `GraphHandle`, its
implementation over a CudaDevice.

A `CudaGraphSplit` holds a GraphHandle, not the device: it can load kernels, capture,
instantiate, update, launch and destroy graphs and say it is gone, and reach nothing
else (memory, staging, the context). split.py and device.py both import this module
and not each other's internals, so they form no import loop.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol


class GraphHost(Protocol):
    """What a compiled split may ask of its device (and nothing more). Thread-safe: the
    device serialises these on its own lock."""

    name: str

    @property
    def closed(self) -> bool: ...

    def function(self, module: str, kernel: str) -> Any:
        """The loaded kernel `kernel` of module `module` (compiled and loaded on first use)."""

    def capture(self, record: Callable[[Any, Any], None]) -> Any:
        """A new CUDA graph of what `record(driver, stream)` enqueues."""

    def instantiate(self, graph: Any) -> Any:
        """An executable graph of `graph` (counted in live_objects)."""

    def update(self, exec_: Any, graph: Any) -> bool:
        """Push `graph` into `exec_` in place (cuGraphExecUpdate); False if the topology differs."""

    def launch(self, exec_: Any) -> None:
        """Launch `exec_` and wait for it."""

    def destroy_exec(self, exec_: Any) -> None: ...

    def destroy_graph(self, graph: Any) -> None: ...

    def forget(self, split: Any) -> None:
        """The split was released: the device no longer needs to release it on close."""


class GraphHandle:
    """A `split.GraphHost` over one CudaDevice: exactly the calls a compiled split makes.

    Holds the device strongly (a split outliving its session must still be able to
    destroy its graphs, as before) but exposes nothing else of it."""

    __slots__ = ("_device",)

    def __init__(self, device: Any):
        self._device = device

    @property
    def name(self) -> str:
        return self._device.name

    @property
    def closed(self) -> bool:
        return self._device.closed

    def function(self, module: str, kernel: str) -> Any:
        return self._device.function(module, kernel)

    def capture(self, record: Callable[[Any, Any], None]) -> Any:
        return self._device.capture(record)

    def instantiate(self, graph: Any) -> Any:
        return self._device.instantiate_graph(graph)

    def update(self, exec_: Any, graph: Any) -> bool:
        return self._device.update_graph_exec(exec_, graph)

    def launch(self, exec_: Any) -> None:
        self._device.launch_graph(exec_)

    def destroy_exec(self, exec_: Any) -> None:
        self._device.destroy_graph_exec(exec_)

    def destroy_graph(self, graph: Any) -> None:
        self._device.destroy_graph(graph)

    def forget(self, split: Any) -> None:
        self._device.forget(split)
