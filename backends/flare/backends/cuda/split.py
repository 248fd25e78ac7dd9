"""A split as a CUDA graph: captured once, replayed by `run()`, updated in place on rebind.

Python launching ~50 kernels one by one costs more than the kernels
themselves on small graphs; a CUDA graph launches them all with one call.
Capture uses stream capture (thread-local mode, so other threads' CUDA calls
are unaffected): the launches are recorded, not executed, so capturing needs
no warm-up run and has no side effects on the tensors.

When only buffer addresses change (the workspace grew and was re-bound), the
split is re-lowered, re-captured into a new graph and pushed into the existing
executable graph with cuGraphExecUpdate, which avoids a new instantiation; if
the topology changed, the executable graph is rebuilt.

A split reaches its device only through a `GraphHost` — the handful of calls a
captured graph needs (load a kernel, capture, instantiate, update, launch,
destroy, say it is gone) — which `CudaDevice` hands it (`graph_host.GraphHandle`).
This module does not import the device: the split cannot reach device
internals (memory, staging, the context) and the two files form no import loop.
"""
from __future__ import annotations

import ctypes
from typing import Any

from flare.core.backend import PreparedSplit, SplitProgram
from flare.core.errors import ReleasedError

from . import lowering
from .driver import call
from .graph_host import GraphHost


def _signature(program: SplitProgram) -> tuple:
    """What must not change for a rebind: the nodes, their ops and shapes."""
    return tuple((n.id, n.op, n.shape) for n in program.nodes)


class CudaGraphSplit(PreparedSplit):
    """The captured program of one split on one CUDA device."""

    def __init__(self, host: GraphHost, program: SplitProgram):
        self.host = host
        self._signature = _signature(program)
        self.plan: list[lowering.Launch] = []
        self.graph: Any = None
        self.exec: Any = None
        self.released = False
        self.captures = 0         # graphs captured (1 + one per rebind)
        self.instantiations = 0   # executable graphs built
        self.updates = 0          # rebinds applied in place with cuGraphExecUpdate
        try:
            self._capture(program)
            self.exec = self._instantiate(self.graph)
        except BaseException:
            self.release()  # a half-built split leaves no graph behind
            raise

    # -- building ---------------------------------------------------------------
    def _capture(self, program: SplitProgram) -> None:
        """Lower the split and record its launches into a new graph (self.graph)."""
        plan = lowering.lower_all(program.nodes, program.binding, program.tuning)
        functions = [self.host.function(launch.module, launch.kernel) for launch in plan]
        if not plan:
            self.plan, self.graph = plan, None  # views only: nothing to run
            return
        graph = self.host.capture(lambda driver, stream: self._launch_all(driver, plan, functions, stream))
        self.plan, self.graph = plan, graph
        self.captures += 1

    @staticmethod
    def _launch_all(driver: Any, plan: list[lowering.Launch], functions: list[Any], stream: Any) -> None:
        for launch, fn in zip(plan, functions):
            # kernelParams: a void*[1] pointing at the KArgs block (copied at capture)
            params = (ctypes.c_void_p * 1)(ctypes.addressof(launch.args))
            call(driver.cuLaunchKernel(fn, *launch.grid, *launch.block, 0, stream, ctypes.addressof(params), 0),
                 f"cuLaunchKernel({launch.kernel} for node {launch.node!r})")

    def _instantiate(self, graph: Any) -> Any:
        if graph is None:
            return None
        exec_ = self.host.instantiate(graph)
        self.instantiations += 1
        return exec_

    # -- the PreparedSplit interface ---------------------------------------------
    def run(self) -> None:
        """Replay the graph and wait for it (the split's outputs are then readable)."""
        if self.released:
            raise ReleasedError(f"CUDA split on {self.host.name} was released")
        if self.exec is None:
            return
        self.host.launch(self.exec)

    def rebind(self, program: SplitProgram) -> bool:
        """Point the captured program at new bindings (same nodes, new addresses).

        Returns True when the executable graph was updated in place, False when
        it had to be rebuilt (topology changed). A different node list is a
        ValueError: that is a new split, to be compiled."""
        if self.released:
            raise ReleasedError(f"CUDA split on {self.host.name} was released")
        if _signature(program) != self._signature:
            raise ValueError("rebind with different nodes: compile a new split instead")
        old_graph, old_exec = self.graph, self.exec
        self._capture(program)
        if old_graph is not None:
            self.host.destroy_graph(old_graph)
        if self.graph is not None and old_exec is not None:
            if self.host.update(old_exec, self.graph):
                self.updates += 1
                return True
        if old_exec is not None:
            self.host.destroy_exec(old_exec)
            self.exec = None
        self.exec = self._instantiate(self.graph)
        return False

    def release(self) -> None:
        """Destroy the executable graph, then the graph. Idempotent."""
        if self.released:
            return
        self.released = True
        try:
            if self.exec is not None:
                exec_, self.exec = self.exec, None
                self.host.destroy_exec(exec_)
        finally:
            if self.graph is not None:
                graph, self.graph = self.graph, None
                self.host.destroy_graph(graph)
            self.plan = []
            self.host.forget(self)

    def __del__(self) -> None:  # a forgotten split must not leak a CUDA graph
        try:
            if not self.released and not self.host.closed:
                self.release()
        except Exception:
            pass

