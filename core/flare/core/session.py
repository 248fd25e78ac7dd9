"""Session: the devices a program runs on, and the owner of its prepared graphs.

`Session(["vulkan", "cpu"])` opens the named backends' devices in priority
order (first is preferred by the scheduler). A name may pick a device:
`cpu:1` opens two logical CPU devices and uses the second. Closing the session
releases every prepared graph it handed out, then closes the devices.

Thread safety: `prepare`, `workspace` and `close` serialise on the session's
lock; executes do not take it (each graph has its own). `close` waits for
executes in flight (through each graph's release) and later ones raise
ReleasedError. The session holds its graphs and workspaces by weak reference
and forgets a graph when it is released, so a long-lived session does not
grow; a session dropped without `close()` is closed by a finalizer with a
ResourceWarning.
"""
from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .backend import Device
from .errors import BackendUnavailable, InputError, ReleasedError
from .plugin_manager import PluginManager, get_plugin_manager
from .prepared import EntryBuilder, HostCallback, PreparedGraph
from .partition import PlacementFn
from .specs import STAGE_EXPERTS
from .workspace import GraphWorkspace


@dataclass(frozen=True)
class ModelPreparation:
    """A registered model read into what `Session.prepare` takes."""

    entries: dict[str, EntryBuilder]
    shapes: dict[str, dict[str, tuple]]
    placement: PlacementFn | None
    callbacks: dict[str, HostCallback]
    name: str


def device_list(text: str, option: str = "--backend") -> list[str]:
    """'vulkan, cpu' -> ['vulkan', 'cpu'] for a command-line option; InputError for an empty list or
    an empty name (',' or 'cpu,,vulkan' must not quietly mean the default) or a malformed name."""
    names = [n.strip() for n in str(text).split(",")]
    if not any(names) or "" in names:
        raise InputError(f"{option} {text!r}: expected device names separated by commas, e.g. vulkan,cpu")
    for n in names:
        parse_device_name(n)
    return names


def parse_device_name(name: str) -> tuple[str, int]:
    """'vulkan' -> ('vulkan', 0); 'cpu:1' -> ('cpu', 1)."""
    backend, _, index = name.partition(":")
    if index and not index.isdigit():
        raise BackendUnavailable(f"device name {name!r}: expected BACKEND or BACKEND:INDEX")
    return backend, int(index or 0)


class Session:
    """Opened devices plus the prepared graphs made on them."""

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        *,
        config: Mapping[str, Mapping[str, Any]] | None = None,
        plugins: PluginManager | None = None,
    ):
        self.plugins = plugins or get_plugin_manager()
        self.config = {k: dict(v) for k, v in (config or {}).items()}
        wanted = list(devices or ["cpu"])
        specs = self.plugins.backends()
        per_backend: dict[str, int] = {}
        for name in wanted:
            backend, index = parse_device_name(name)
            if backend not in specs:
                raise BackendUnavailable(f"unknown backend {backend!r}; installed: {', '.join(specs) or 'none'}")
            per_backend[backend] = max(per_backend.get(backend, 0), index + 1)
        opened: dict[str, list[Device]] = {}
        try:
            for backend, count in per_backend.items():
                cls = specs[backend].backend
                probe = cls.probe()
                if not probe.usable:
                    raise BackendUnavailable(f"backend {backend!r} is not usable here: {probe.reason}")
                cfg = dict(self.config.get(backend, {}))
                cfg["count"] = max(count, int(cfg.get("count", 1)))
                devs = cls.open_devices(cfg)
                if len(devs) < count:
                    raise BackendUnavailable(f"backend {backend!r} has {len(devs)} device(s); {name!r} asks for index {count - 1}")
                opened[backend] = devs
        except BaseException:
            for devs in opened.values():
                for d in devs:
                    d.close()
            raise
        self._all_devices = [d for devs in opened.values() for d in devs]
        self.devices: list[Device] = []
        for name in wanted:
            backend, index = parse_device_name(name)
            dev = opened[backend][index]
            if dev not in self.devices:
                self.devices.append(dev)
        self._lock = threading.RLock()
        self._keys = itertools.count()
        # weak: a released or dropped graph (and its weights) must not stay reachable from here
        self._graphs: weakref.WeakValueDictionary[int, PreparedGraph] = weakref.WeakValueDictionary()
        self._workspaces: weakref.WeakValueDictionary[int, GraphWorkspace] = weakref.WeakValueDictionary()
        self.closed = False
        self._finalizer = weakref.finalize(self, _close_dropped, repr(self), self._graphs, self._workspaces,
                                           list(self._all_devices))
        self._finalizer.atexit = False

    def device(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name or d.name == f"{name}:0":
                return d
        raise BackendUnavailable(f"no device {name!r} in this session ({', '.join(d.name for d in self.devices)})")

    def workspace(self, name: str = "workspace", headroom: float = 1.0) -> GraphWorkspace:
        """A new workspace for graphs that never run at the same time (`headroom`: see GraphWorkspace)."""
        with self._lock:
            self._check_open()
            ws = GraphWorkspace(name, headroom)
            self._workspaces[next(self._keys)] = ws
            return ws

    def prepare(
        self,
        entries: Mapping[str, EntryBuilder],
        shapes: Mapping[str, Mapping[str, Sequence[int]]],
        *,
        workspace: GraphWorkspace | None = None,
        placement: PlacementFn | None = None,
        strict: bool = False,
        name: str = "graph",
        callbacks: Mapping[str, HostCallback] | None = None,
        tuning: Mapping[str, Mapping[str, str]] | None = None,
    ) -> PreparedGraph:
        """Prepare a graph's entry points (see PreparedGraph). A private workspace is
        made when none is given. `tuning` maps entry -> {"BACKEND.op": variant}
        (kernel variants an exported core measured best)."""
        with self._lock:
            self._check_open()
            # a private workspace lives and dies with its graph: the session need not track it
            ws = workspace or GraphWorkspace(f"{name}:workspace")
            graph = PreparedGraph(self, entries, shapes, workspace=ws, placement=placement, strict=strict,
                                  name=name, callbacks=callbacks, tuning=tuning)
            graph._session_key = key = next(self._keys)
            self._graphs[key] = graph
            return graph

    def _forget(self, graph: PreparedGraph) -> None:
        """A graph was released: drop it (called under the graph's lock, so no session lock here)."""
        key = getattr(graph, "_session_key", None)
        if key is not None:
            self._graphs.pop(key, None)

    def live_graphs(self) -> list[PreparedGraph]:
        """Graphs handed out and neither released nor dropped, oldest first."""
        return list(self._graphs.values())

    def model_preparation(self, model: str, options: Mapping[str, Any] | None = None, *,
                          placement: PlacementFn | None = None) -> ModelPreparation:
        """Read a registered model's `ModelSpec` into what `prepare` takes.

        `spec.graph(options)` gives the entries and their first shapes; the spec's
        placement callback places nodes unless `placement` is given; the spec's
        `stage_experts(options)`, if any, becomes the graph's `stage_experts` host
        callback. (`prepare_model` is this plus `prepare`; wrappers that prepare
        differently, like the benchmark's one-workspace-per-entry session, use it.)
        """
        spec = self.plugins.model(model)
        options = dict(options or {})
        graph = spec.graph(options)
        callbacks = dict(graph.callbacks)
        if spec.stage_experts is not None:
            stager = spec.stage_experts(options)
            if stager is not None:
                callbacks[STAGE_EXPERTS] = stager
        return ModelPreparation(dict(graph.entries), {e: dict(s) for e, s in graph.shapes.items()},
                                placement if placement is not None else spec.placement, callbacks,
                                graph.name or model)

    def prepare_model(
        self,
        model: str,
        options: Mapping[str, Any] | None = None,
        *,
        shapes: Mapping[str, Mapping[str, Sequence[int]]] | None = None,
        placement: PlacementFn | None = None,
        workspace: GraphWorkspace | None = None,
        strict: bool = False,
        tuning: Mapping[str, Mapping[str, str]] | None = None,
    ) -> PreparedGraph:
        """Prepare a registered model: the runtime reads the model plugin's `ModelSpec`
        (see `model_preparation`). The model's own code passes none of its callbacks:
        a plugin that only registers a ModelSpec is prepared, placed and staged the same
        way by `flare run`, `flare describe` and `flare bench`. `shapes` overrides the
        model's first shapes."""
        self._check_open()
        p = self.model_preparation(model, options, placement=placement)
        return self.prepare(p.entries, shapes if shapes is not None else p.shapes, workspace=workspace,
                            placement=p.placement, strict=strict, name=p.name, callbacks=p.callbacks, tuning=tuning)

    def close(self) -> None:
        """Release prepared graphs (waiting for executes in flight), then workspaces, then devices. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._finalizer.detach()
            _close(self._graphs, self._workspaces, self._all_devices)

    def _check_open(self) -> None:
        if self.closed:
            raise ReleasedError("session is closed")

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({[d.name for d in self.devices]})"


def _close(graphs: "weakref.WeakValueDictionary[int, PreparedGraph]",
           workspaces: "weakref.WeakValueDictionary[int, GraphWorkspace]", devices: list[Device]) -> None:
    """Graphs, then workspaces, then devices; every step runs, the first failure is raised after."""
    first_error: BaseException | None = None
    for group, method in ((list(graphs.values()), "release"), (list(workspaces.values()), "release"),
                          (devices, "close")):
        for obj in group:
            try:
                getattr(obj, method)()
            except BaseException as exc:
                first_error = first_error or exc
    graphs.clear()
    workspaces.clear()
    if first_error is not None:
        raise first_error


def _close_dropped(name: str, graphs: "weakref.WeakValueDictionary[int, PreparedGraph]",
                   workspaces: "weakref.WeakValueDictionary[int, GraphWorkspace]", devices: list[Device]) -> None:
    """Finalizer of a Session garbage-collected without close()."""
    warnings.warn(f"{name} was dropped without close(); closing its graphs and {len(devices)} device(s) now",
                  ResourceWarning, stacklevel=2)
    _close(graphs, workspaces, devices)
