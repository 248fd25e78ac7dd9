"""A loaded core, prepared on devices: one PreparedGraph whose entry points are the selected programs.

All programs share weights (uploaded once, by name), the KV state (shared by
name) and the workspace arenas, so memory is weights + state + the largest
program's arena, not a sum. Weights are memory-mapped from the safetensors
file at the offsets the validated header gave and copied to the device once;
under expert parallelism each rank maps only its experts' rows. The selected
tuning choices are handed per program to the prepared graph, which gives each
split its backend's variants (the CPU device binds them; others ignore them).
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Sequence

import numpy as np

from flare.core.dtypes import to_numpy
from flare.core.ledger import LEDGER
from flare.core.serialize import builder_from_dict
from flare.core.session import Session

from .expert_parallel import ALLREDUCE, LOCAL_IDS, Partition, local_ids, make_allreduce, rewrite, slice_loader
from .loader import LoadedCore


class CoreRuntime:
    """Execute selected programs by name; counts launches and time per program."""

    def __init__(self, core: LoadedCore, *, devices: Sequence[str] | None = None,
                 partition: Partition | None = None, comm: Any = None):
        self.core = core
        self.partition = partition or Partition()
        if self.partition.size > 1 and comm is None:
            raise ValueError("expert parallelism over several ranks needs an MPI communicator")
        devs = list(devices or [core.backend])
        if not any(d.split(":")[0] == "cpu" for d in devs):
            devs.append("cpu")  # host fallback, as the model CLIs do
        # per program: {"BACKEND.kernel": variant} of the tuning entries it depends on
        tuning = {name: {f"{core.tuning[k].backend}.{core.tuning[k].kernel}": core.tuning[k].choice
                         for k in prog.tuning if k in core.tuning}
                  for name, prog in core.programs.items()}
        self._map: np.memmap | None = None   # the weights file, mapped while weights are uploaded
        self.session = Session(devs)
        try:
            entries, shapes, self.local_experts = self._entries()
            callbacks: dict[str, Callable[..., np.ndarray]] = {LOCAL_IDS: local_ids}
            if comm is not None:
                callbacks[ALLREDUCE] = make_allreduce(comm)
            self.graph = self.session.prepare(entries, shapes, callbacks=callbacks, tuning=tuning,
                                              name=f"core:{core.manifest.model}")
        except BaseException:
            self.session.close()
            raise
        finally:
            self._map = None   # weights are on the device now; unmap the file (re-mapped if ever needed)
        self.launches: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self.released = False

    def _weight(self, name: str) -> Callable[[], np.ndarray]:
        info = self.core.weights[name]

        def load() -> np.ndarray:
            if self._map is None:
                self._map = np.memmap(self.core.weights_path, dtype=np.uint8, mode="r")
            raw = self._map[info["offset"]: info["offset"] + info["nbytes"]]
            return raw.view(to_numpy(info["dtype"])).reshape(info["shape"])
        return load

    def _entries(self) -> tuple[dict[str, Any], dict[str, dict[str, tuple]], int]:
        entries: dict[str, Any] = {}
        shapes: dict[str, dict[str, tuple]] = {}
        experts = 0
        for name, data in self.core.graphs.items():
            local, slices = rewrite(data, self.partition)
            weights: dict[str, Callable[[], np.ndarray]] = {w: self._weight(w) for w in self.core.programs[name].weights}
            for lname, s in slices.items():
                weights[lname] = slice_loader(weights[s.source], s)
                experts = max(experts, s.stop - s.start)
            build = builder_from_dict(local, weights, where=name)
            entries[name] = build
            shapes[name] = {n: t.shape for n, t in build.graph.inputs.items()}
        return entries, shapes, experts

    @property
    def programs(self) -> dict[str, Any]:
        return self.core.programs

    def execute(self, program: str, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """Run one program (one launch)."""
        t0 = time.perf_counter()
        out = self.graph.execute(program, **inputs)
        self.seconds[program] += time.perf_counter() - t0
        self.launches[program] += 1
        return out

    def memory(self) -> dict[str, Any]:
        """Bytes per device: persistent (weights, state, inputs), workspace arenas, ledger live and peak."""
        persistent = self.graph.persistent_bytes()
        out = {}
        for dev in self.session.devices:
            out[dev.name] = {"persistent_bytes": persistent.get(dev.name, 0),
                             "workspace_bytes": self.graph.workspace.nbytes(dev.name),
                             "live_bytes": LEDGER.live_bytes(dev.name), "peak_bytes": LEDGER.peak_bytes(dev.name)}
        return out

    def release(self) -> None:
        """Release the graph and the session; idempotent."""
        if self.released:
            return
        self.released = True
        try:
            self.session.close()
        finally:
            self.graph = None  # type: ignore[assignment]
            self._map = None  # type: ignore[assignment]

    def __enter__(self) -> "CoreRuntime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
