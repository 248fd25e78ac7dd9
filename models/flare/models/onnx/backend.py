"""ONNX's backend interface (`onnx.backend.base.Backend` / `BackendRep`) over Flare.

This is what ONNX's own backend test suite (`onnx.backend.test.BackendTest`)
drives. The suite's device strings know only "CPU" and "CUDA"; which Flare
backend runs is chosen separately: `FlareBackend.for_devices(["vulkan", "cpu"])`
makes a backend class bound to those Flare devices (the pytest matrix passes
its selected backend). Each `prepare` opens no Session of its own: all reps of
one backend class share one Session, closed by `close()`.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

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
    """Flare as an ONNX backend on the devices of `DEVICES` (a session shared by its reps)."""

    DEVICES: tuple[str, ...] = ("cpu",)
    _session: Any = None
    _reps: list = []
    _lock = threading.Lock()

    @classmethod
    def for_devices(cls, devices: Sequence[str]) -> type["FlareBackend"]:
        """A backend class bound to these Flare devices, with a session of its own."""
        return type(f"FlareBackend_{'_'.join(devices)}", (cls,), {"DEVICES": tuple(devices), "_session": None,
                                                                  "_reps": [], "_lock": threading.Lock()})

    @classmethod
    def session(cls):
        with cls._lock:
            if cls._session is None:
                from flare.core.session import Session

                cls._session = Session(list(cls.DEVICES))
            return cls._session

    @classmethod
    def close(cls) -> None:
        """Release every rep's graphs, then the session."""
        with cls._lock:
            for rep in cls._reps:
                rep.release()
            cls._reps = []
            if cls._session is not None:
                cls._session.close()
                cls._session = None

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
            # keep only the last few reps' graphs alive: the suite prepares ~2000 models
            cls._reps.append(rep)
            while len(cls._reps) > 4:
                cls._reps.pop(0).release()
        return rep

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: Any, inputs: Any, device: str = "CPU", outputs_info: Any = None, **kwargs: Any):
        raise NotImplementedError("run_node: the suite runs whole models (load_model_tests)")
