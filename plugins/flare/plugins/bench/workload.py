"""Workload kinds: what `flare bench` knows about each model, keyed by model name.

Why a registry: the harness (order of runs, timing, memory, comparison,
report) is the same for every model; what differs is how a request looks
(audio clip, batch of sentences, prompt), which options a configuration may
set, which peers exist, what "faster" is measured in and how close two outputs
must be. A `Workload` says exactly that. Model plugins contribute kinds
through the `flare_bench_workloads` hook and other ways to serve the same
requests (onnxruntime, NumPy) through `flare_bench_peers` (both declared in
`flare.plugins.bench.hookspecs`); the hooks are called on first use, so
`flare --help` imports no onnxruntime and no model.

The moe-lm kind makes "experts resident vs offloaded" an option (`experts`);
the moe-lm-serving kind makes "mixed prefill on/off" one (`mixed_prefill`, on an
exported core under a concurrent workload). A kind only has to list its
options; the config parser, the pair check and the report need no change.
"""
from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Protocol, Sequence

import numpy as np

from .errors import BenchConfigError

if TYPE_CHECKING:
    from .config import BenchConfig

@dataclass(frozen=True)
class Option:
    """One model-specific configuration key (under `[options]` in the TOML).

    `kind` is one of bool, int, float, str, "paths" (a list of file names,
    relative to the TOML file, where `keywords` are accepted as-is).
    `shapes_requests`: the option decides what the requests are, so both
    configurations of a comparison must give it the same value (otherwise
    their outputs could not be compared)."""

    kind: Any
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    shapes_requests: bool = False
    keywords: tuple[str, ...] = ()


@dataclass(frozen=True)
class Metric:
    """How a run's speed is stated. `per_work`: seconds of processing per unit of
    work (RTF for audio, lower is better); otherwise units per second (higher is better)."""

    name: str            # "RTF", "sentences/s", "tokens/s"
    work_unit: str       # "audio s", "sentences", "tokens"
    per_work: bool

    def value(self, seconds: float, work: float) -> float:
        if self.per_work:
            return seconds / work if work else float("nan")
        return work / seconds if seconds else float("nan")

    @property
    def lower_is_better(self) -> bool:
        return self.per_work


RTF = Metric("RTF", "audio s", per_work=True)


@dataclass(frozen=True)
class Request:
    """One request, served the same way by both configurations.

    `work` is what the metric counts (audio seconds, sentences, tokens)."""

    index: int
    payload: Any
    work: float
    label: str = ""


@dataclass
class Timed:
    """A runner's answer: the output to compare and the seconds it took.

    Runners time themselves so that what is inside the timed region is decided
    where the work is done (a rebuilt-each-request runner counts build, run and
    release; it does not count the describe() it keeps for the report)."""

    output: np.ndarray
    seconds: float
    # further per-request figures a workload reports (time to first token, launches...);
    # the report shows each one's median for A and B
    extras: dict[str, float] = field(default_factory=dict)


def timed_output(result: "np.ndarray | tuple[np.ndarray, dict[str, float]]", seconds: float) -> Timed:
    """A runner's `Timed` from what a workload's infer/compute returned: the output alone,
    or (output, extras) where the workload times parts of a request itself (decode ms per
    token inside a prefill + decode request, say)."""
    if isinstance(result, tuple):
        out, extras = result
        return Timed(out, seconds, dict(extras))
    return Timed(result, seconds)


class Runner(Protocol):
    """A configuration made runnable: opened once per run, then fed the requests."""

    description: str

    def run(self, request: Request) -> Timed: ...

    def memory_plan(self) -> dict[str, Any] | None:
        """Arena bytes per entry/device (PreparedGraph.describe()), or None for peers."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Peer:
    """A way to serve the requests: `flare`, or another runtime to compare with.

    `model`: the workload kind it serves; `module`: the Python package it needs
    (checked with find_spec, never imported at parse time); `open(config)`
    returns its Runner (outside the timings). `flare` itself has no `open`: the
    workload opens Flare's runner."""

    name: str
    help: str
    module: str | None = None
    model: str = ""
    open: "Callable[[BenchConfig], Runner] | None" = None
    takes_threads: bool = False     # its `open` honours the configuration's top-level `threads`


FLARE_PEER = Peer("flare", "Flare's own graphs on the configured backends")


class Workload(ABC):
    """Base of every workload kind; subclasses fill the class attributes."""

    model: ClassVar[str]
    metric: ClassVar[Metric]
    tolerance: ClassVar[float]          # largest |a - b| counted as the same output
    peers: tuple[Peer, ...] = (FLARE_PEER,)   # set from the flare_bench_peers hook
    options: ClassVar[Mapping[str, Option]] = {}
    # True: any key under [options] is taken as is and handed to the model (the generic graph
    # workload: a ModelSpec declares no option schema, its `graph(options)` checks them)
    free_options: ClassVar[bool] = False
    default_requests: ClassVar[int] = 8
    # can the model's entry points be prepared as separate graphs (workspace_sharing = false)?
    # False where entries share state (a KV cache written by one entry, read by another).
    entries_separable: ClassVar[bool] = True
    # Flare's runner honours the top-level `threads` (the CPU device's threads); a kind whose
    # runner builds its devices elsewhere leaves it False, and `threads` is then an error
    threads_supported: ClassVar[bool] = False

    def peer(self, name: str) -> Peer | None:
        return next((p for p in self.peers if p.name == name), None)

    def peer_unavailable(self, name: str) -> str | None:
        """Why peer `name` cannot run here (None if it can)."""
        peer = self.peer(name)
        if peer is None:
            return f"no peer {name!r} for {self.model}; peers: {', '.join(p.name for p in self.peers)}"
        if peer.module and importlib.util.find_spec(peer.module) is None:
            return f"peer {name!r} needs the Python package {peer.module!r}, which is not importable here"
        return None

    def validate(self, config: "BenchConfig") -> None:
        """Checks across options (raise BenchConfigError naming the key). Default: none."""

    @abstractmethod
    def requests(self, config: "BenchConfig", count: int) -> list[Request]:
        """The `count` requests both configurations serve (deterministic)."""

    def open(self, config: "BenchConfig") -> Runner:
        """Open the configuration's runner (outside the timings): a peer's, or Flare's."""
        peer = self.peer(config.peer)
        if peer is not None and peer.open is not None:
            return peer.open(config)
        return self.open_flare(config)

    @abstractmethod
    def open_flare(self, config: "BenchConfig") -> Runner:
        """Flare's runner for this configuration."""

    def describe_config(self, config: "BenchConfig") -> str:
        """One line for tables: peer, devices and the options that differ from the defaults."""
        parts = [config.peer if config.peer != "flare" else "flare " + ",".join(config.backends)]
        if config.peer == "flare":
            parts.append("prepared" if config.prepared else "rebuilt/request")
            if not config.workspace_sharing:
                parts.append("no ws sharing")
        for key, opt in self.options.items():
            value = config.options.get(key, opt.default)
            if value != opt.default and not opt.shapes_requests:
                parts.append(f"{key}={value}")
        return ", ".join(parts)


def _collect(pm: Any) -> dict[str, Workload]:
    found: dict[str, Workload] = {}
    for kinds in pm.hook.flare_bench_workloads():
        for kind in kinds or []:
            inst = kind() if isinstance(kind, type) else kind
            if inst.model in found:
                raise BenchConfigError(f"two bench workloads for model {inst.model!r}: "
                                       f"{type(found[inst.model]).__name__} and {type(inst).__name__}")
            found[inst.model] = inst
    for peers in pm.hook.flare_bench_peers():
        for peer in peers or []:
            if peer.model not in found:
                continue      # a peer of a model whose workload is not installed
            w = found[peer.model]
            if w.peer(peer.name) is not None:
                raise BenchConfigError(f"two bench peers named {peer.name!r} for model {peer.model!r}")
            w.peers = (*w.peers, peer)
    return found


_REGISTRY: dict[int, dict[str, Workload]] = {}


def workloads() -> dict[str, Workload]:
    """Workload kinds by model name, from every plugin's `flare_bench_workloads` and
    `flare_bench_peers` (collected once per plugin manager)."""
    from flare.core.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    key = id(pm)
    if key not in _REGISTRY:
        _REGISTRY.clear()
        _REGISTRY[key] = _collect(pm)
    return _REGISTRY[key]


def forget_workloads() -> None:
    """Collect the hooks again on next use (after registering a plugin by hand)."""
    _REGISTRY.clear()


def known_models() -> list[str]:
    """Model names a configuration may name: those with a workload, and every registered model."""
    from flare.core.plugin_manager import get_plugin_manager

    return sorted(set(workloads()) | set(get_plugin_manager().models()))


def get_workload(model: str, *, path: Any = None) -> Workload:
    """The workload kind of `model` (a registered model without one gets the generic graph
    workload); BenchConfigError (key 'model') when there is no such model."""
    from flare.core.plugin_manager import get_plugin_manager

    found = workloads()
    if model in found:
        return found[model]
    if model in get_plugin_manager().models():
        from .graph_workload import GraphWorkload

        found[model] = GraphWorkload(model)
        return found[model]
    raise BenchConfigError(f"unknown model {model!r}; flare bench knows {', '.join(known_models())}",
                           path=path, key="model")


def cycle(items: Sequence[Any], count: int) -> list[Any]:
    """items[0], items[1], ... repeated up to `count` entries (requests from a small pool)."""
    if not items:
        raise ValueError("no items to build requests from")
    return [items[i % len(items)] for i in range(count)]

