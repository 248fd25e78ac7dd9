"""Small frozen records that registration hooks return (as conda and tox do).

They are data, not behaviour: the manager collects them, checks names are
unique, and the rest of Flare reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class BackendSpec:
    """A backend plugin: `backend` is a `flare.backend.Backend` subclass.

    `priority`: higher is preferred by the scheduler when several backends can
    run a node (GPU backends above the CPU).
    """

    name: str
    backend: type
    version: str = "0"
    priority: int = 0
    description: str = ""


@dataclass(frozen=True)
class ModelSpec:
    """A model plugin.

    - `entries` maps entry names (`full`, `body`, `prefill`, `decode`, ...) to
      builders `build(builder, shapes)` that add one entry point's graph for the
      given input shapes (what `Session.prepare` calls).
    - `load_weights(config) -> Mapping[str, ndarray | loader]` finds the weights.
    - `placement(tensor, devices) -> device name | None` overrides where a node
      or weight goes (None: let the scheduler decide).
    - `stage_experts(...)`: makes the selected MoE experts resident before an
      expert matmul (None for models without experts).
    - `run`: optional command-line main job (`flare run NAME ...`), given argv.
    - `prepare(session) -> PreparedGraph`: the model prepared with default
      options (used by `flare describe` and benchmarks).
    """

    name: str
    description: str
    entries: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    load_weights: Callable[..., Mapping[str, Any]] | None = None
    placement: Callable[..., str | None] | None = None
    stage_experts: Callable[..., Any] | None = None
    run: Callable[[list[str]], int] | None = None
    prepare: Callable[..., Any] | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    version: str = "0"
