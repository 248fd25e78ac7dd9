"""ONNX's backend interface (`onnx.backend.base.Backend` / `BackendRep`) over Flare.

This is what ONNX's own backend test suite (`onnx.backend.test.BackendTest`)
drives. The suite's device strings know only "CPU" and "CUDA"; which Flare
backend runs is chosen separately: `FlareBackend.for_devices(["vulkan", "cpu"])`
makes a backend class bound to those Flare devices (the pytest matrix passes
its selected backend). Each `prepare` opens no Session of its own: all reps of
one backend class share one Session, closed by `close()`.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import numpy as np
from onnx.backend.base import Backend, BackendRep

from .loader import from_proto
from .runner import OnnxRunner


class FlareRep(BackendRep):
    """A prepared model: `run(inputs)` takes a list (graph-input order) or a dict."""

    def __init__(self, runner: OnnxRunner):
        self.runner = runner

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        names = self.runner.model.input_names
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feeds = {n: np.asarray(v) for n, v in zip(names, inputs)}
        outs = self.runner.run(feeds)
        return tuple(outs[n] for n in self.runner.model.output_names)

    def release(self) -> None:
        self.runner.release()


class FlareBackend(Backend):
    """Flare as an ONNX backend on the Flare devices of `DEVICES`.

    Reps share one Session per device list (opening Vulkan is slow; the suite
    prepares ~2,000 models); `using(devices)` switches the devices of later
    `prepare` calls (the pytest matrix does, per backend), `close()` releases
    every rep's graphs and then the sessions. Not for concurrent use: the suite
    is sequential."""

    DEVICES: tuple[str, ...] = ("cpu",)
    KEEP_REPS = 4  # reps whose prepared graphs stay alive; older ones are released
    _sessions: dict = {}
    _reps: list = []
    _lock = threading.Lock()

    @classmethod
    def for_devices(cls, devices: Sequence[str]) -> type["FlareBackend"]:
        """A backend class bound to these Flare devices, with sessions of its own."""
        return type(f"FlareBackend_{'_'.join(devices)}", (cls,), {"DEVICES": tuple(devices), "_sessions": {},
                                                                  "_reps": [], "_lock": threading.Lock()})

    @classmethod
    @contextlib.contextmanager
    def using(cls, devices: Sequence[str]) -> Iterator[None]:
        old = cls.DEVICES
        cls.DEVICES = tuple(devices)
        try:
            yield
        finally:
            cls.DEVICES = old

    @classmethod
    def session(cls):
        with cls._lock:
            sess = cls._sessions.get(cls.DEVICES)
            if sess is None:
                from flare.core.session import Session

                sess = cls._sessions[cls.DEVICES] = Session(list(cls.DEVICES))
            return sess

    @classmethod
    def close(cls) -> None:
        """Release every rep's graphs, then the sessions."""
        with cls._lock:
            for rep in cls._reps:
                rep.release()
            cls._reps = []
            for sess in cls._sessions.values():
                sess.close()
            cls._sessions = {}

    @classmethod
    def is_compatible(cls, model: Any, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> FlareRep:
        onnx_model = from_proto(model, "<memory>")
        runner = OnnxRunner(onnx_model, cls.session(), cache_size=2)
        rep = FlareRep(runner)
        with cls._lock:
            cls._reps.append(rep)
            while len(cls._reps) > cls.KEEP_REPS:
                cls._reps.pop(0).release()
        return rep

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: Any, inputs: Any, device: str = "CPU", outputs_info: Any = None, **kwargs: Any):
        raise NotImplementedError("run_node: the suite runs whole models (load_model_tests)")
