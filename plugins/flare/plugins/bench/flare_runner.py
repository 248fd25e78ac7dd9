"""The `flare` peer: a model runner on a Session, prepared once or rebuilt per request.

Every model kind serves requests through an object with `.pg` (its
PreparedGraph) and `.release()` (SileroVad, MiniLM, ...). This module owns
what is common: opening the devices, `prepared` (build once, `infer` every
request) vs rebuilt (build, infer, release inside each request's timing; the
devices stay open, because opening a device is not part of a graph's
lifecycle), and `workspace_sharing = false` through `PerEntrySession`.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, TypeVar

import numpy as np

from .workload import Request, Timed, timed_output

if TYPE_CHECKING:
    from flare.core.session import Session

    from .config import BenchConfig


class ModelObject(Protocol):
    pg: Any

    def release(self) -> None: ...


M = TypeVar("M", bound=ModelObject)


class FlareRunner(Generic[M]):
    """`build(session) -> model` and `infer(model, request) -> output` supplied by a workload
    (or `-> (output, extras)`: per-request figures it times itself, see `timed_output`)."""

    def __init__(self, config: "BenchConfig", build: Callable[[Any], M], infer: Callable[[M, Request], np.ndarray]):
        from flare.core.session import Session

        from .unshared import PerEntrySession

        self.config = config
        self._build = build
        self._infer = infer
        self.session: Session = Session(list(config.backends), config=config.cpu_config())
        self._target: Any = self.session if config.workspace_sharing else PerEntrySession(self.session)
        self._plan: dict[str, Any] | None = None
        self.model: M | None = None
        threads = sorted({getattr(d, "threads", None) for d in self.session.devices} - {None})
        self.description = (f"flare on {','.join(d.name for d in self.session.devices)}, "
                            f"{'/'.join(map(str, threads)) + ' CPU thread(s), ' if threads else ''}"
                            f"{'prepared once' if config.prepared else 'rebuilt every request'}"
                            f"{'' if config.workspace_sharing else ', one workspace per entry point'}")
        try:
            if config.prepared:
                self.model = build(self._target)
        except BaseException:
            self.session.close()
            raise

    def run(self, request: Request) -> Timed:
        if self.model is not None:
            t0 = time.perf_counter()
            out = self._infer(self.model, request)
            return timed_output(out, time.perf_counter() - t0)
        t0 = time.perf_counter()
        model = self._build(self._target)
        try:
            out = self._infer(model, request)
            elapsed = time.perf_counter() - t0
            self._plan = model.pg.describe()      # outside the timing: the last request's plans
        finally:
            t1 = time.perf_counter()
            model.release()
            release_s = time.perf_counter() - t1
        return timed_output(out, elapsed + release_s)

    def memory_plan(self) -> dict[str, Any] | None:
        """describe() of the prepared graph(s) as last used (planned / lower bound / naive arena bytes)."""
        if self.model is not None:
            return self.model.pg.describe()
        return self._plan

    def close(self) -> None:
        try:
            if self.model is not None:
                self.model.release()
                self.model = None
        finally:
            self.session.close()
