"""Workload kinds: what `flare bench` knows about each model, keyed by model name.

Why a registry: the harness (order of runs, timing, memory, comparison,
report) is the same for every model; what differs is how a request looks
(audio clip, batch of sentences, prompt), which options a configuration may
set, which peers exist, what "faster" is measured in and how close two outputs
must be. A `Workload` says exactly that. Built-in kinds are imported lazily
(`BUILTIN`), so `flare --help` does not import onnxruntime or a model; other
packages add kinds with `register_workload` or through the entry point group
`flare.plugins.bench.workloads` (each entry point names a Workload subclass).

The moe-lm kind makes "experts resident vs offloaded" an option (`experts`);
the moe-lm-serving kind makes "mixed prefill on/off" one (`mixed_prefill`, on an
exported core under a concurrent workload). A kind only has to list its
options; the config parser, the pair check and the report need no change.
"""
from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol, Sequence

import numpy as np

from .errors import BenchConfigError

if TYPE_CHECKING:
    from .config import BenchConfig

ENTRY_POINT_GROUP = "flare.plugins.bench.workloads"

# model name -> module defining its Workload subclass (imported on first use)
BUILTIN: dict[str, str] = {
    "silero-vad": "flare.plugins.bench.workloads.silero_vad",
    "minilm-l6": "flare.plugins.bench.workloads.minilm",
    "moe-lm": "flare.plugins.bench.workloads.moe_lm",
    "moe-lm-serving": "flare.plugins.bench.workloads.moe_serving",
}

_REGISTRY: dict[str, "Workload"] = {}


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

    `module`: the module it needs (checked with find_spec, never imported at parse time)."""

    name: str
    help: str
    module: str | None = None


FLARE_PEER = Peer("flare", "Flare's own graphs on the configured backends")


class Workload(ABC):
    """Base of every workload kind; subclasses fill the class attributes."""

    model: ClassVar[str]
    metric: ClassVar[Metric]
    tolerance: ClassVar[float]          # largest |a - b| counted as the same output
    peers: ClassVar[tuple[Peer, ...]] = (FLARE_PEER,)
    options: ClassVar[Mapping[str, Option]] = {}
    default_requests: ClassVar[int] = 8
    # can the model's entry points be prepared as separate graphs (workspace_sharing = false)?
    # False where entries share state (a KV cache written by one entry, read by another).
    entries_separable: ClassVar[bool] = True

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

    @abstractmethod
    def open(self, config: "BenchConfig") -> Runner:
        """Open the configuration's runner (outside the timings)."""

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


def register_workload(workload: Workload | type[Workload], *, replace: bool = False) -> Workload:
    """Add a workload kind (an instance or a subclass); a second kind for one model is an error
    unless `replace`."""
    inst = workload() if isinstance(workload, type) else workload
    name = inst.model
    if name in _REGISTRY and not replace and type(_REGISTRY[name]) is not type(inst):
        raise ValueError(f"a bench workload for {name!r} is already registered ({type(_REGISTRY[name]).__name__})")
    _REGISTRY[name] = inst
    return inst


def _load_entry_points() -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            register_workload(ep.load())


def known_models() -> list[str]:
    """Model names a configuration may name (built-in, registered, entry points)."""
    try:
        _load_entry_points()
    except Exception:  # a broken third-party entry point must not hide the built-ins
        pass
    return sorted(set(BUILTIN) | set(_REGISTRY))


def get_workload(model: str, *, path: Any = None) -> Workload:
    """The workload kind of `model`; BenchConfigError (key 'model') when there is none."""
    if model not in _REGISTRY and model in BUILTIN:
        importlib.import_module(BUILTIN[model])   # the module registers its kind
    if model not in _REGISTRY:
        known_models()
    if model not in _REGISTRY:
        raise BenchConfigError(f"unknown model {model!r}; flare bench knows {', '.join(known_models())}",
                               path=path, key="model")
    return _REGISTRY[model]


def cycle(items: Sequence[Any], count: int) -> list[Any]:
    """items[0], items[1], ... repeated up to `count` entries (requests from a small pool)."""
    if not items:
        raise ValueError("no items to build requests from")
    return [items[i % len(items)] for i in range(count)]

