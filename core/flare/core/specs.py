"""Small frozen records that registration hooks return (as conda and tox do).

They are data, not behaviour: the plugin manager collects them, checks names
are unique, and the runtime reads them. Every field is read by the runtime
(`Session.prepare_model`, the CLI); there are no fields "for later".
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from .graph import GraphBuilder, Tensor

EntryBuilder = Callable[["GraphBuilder", Mapping[str, tuple]], None]
# (tensor, devices: flare.core.partition.PlacementDevices) -> device name | Prefer(name) | None
PlacementFn = Callable[["Tensor", list], Any]
HostCallback = Callable[..., Any]

# the name of the host callback a model graph calls before an expert matmul; the runtime
# binds it to the model's registered `ModelSpec.stage_experts`
STAGE_EXPERTS = "stage_experts"


@dataclass(frozen=True)
class BackendSpec:
    """A backend plugin: `backend` is a `flare.core.backend.Backend` subclass.

    `priority` orders backends in listings: `flare backends` and the test
    matrix's default `--backends` (highest first). It places nothing: the
    scheduler prefers devices in the order the session was given them, which
    the caller chooses (`Session(["vulkan", "cpu"])`, `--backends vulkan,cpu`).
    """

    name: str
    backend: type
    version: str = "0"
    priority: int = 0
    description: str = ""


@dataclass(frozen=True)
class ModelGraph:
    """What a model gives the runtime to prepare: entry builders, the input shapes
    each entry is first prepared for, and host callbacks its graph names (other
    than expert staging, which comes from the `ModelSpec`). `name` names the
    PreparedGraph (ledger tags, describe output)."""

    entries: Mapping[str, EntryBuilder]
    shapes: Mapping[str, Mapping[str, tuple]]
    callbacks: Mapping[str, HostCallback] = field(default_factory=dict)
    name: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    """A model plugin, as the runtime uses it.

    - `graph(options) -> ModelGraph`: the model's entry points and shapes for
      the given options (sizes, weights, batch limits); `Session.prepare_model`
      calls it.
    - `placement(tensor, devices) -> device name | Prefer(name) | None`: where a
      node or weight goes (None: the scheduler decides; a name insists, `Prefer`
      falls back where that device cannot run the node). `devices` lists the
      session's device names and answers `devices.can_run(node, name)`
      (`flare.core.partition.PlacementDevices`). `Session.prepare_model` hands it
      to the scheduler unless the caller gives a placement of its own.
    - `stage_experts(options) -> callback | None`: for MoE models, makes the
      selected experts resident before an expert matmul. The runtime calls the
      factory once per prepared model and binds the callback to the graph's host
      nodes named `stage_experts` (`STAGE_EXPERTS`); None keeps experts resident.
    - `run(argv) -> exit code`: the model's own command-line job (`flare run
      NAME ...`); without it `flare run NAME` prepares the model's graph and
      executes its entries on given or zero inputs.
    """

    name: str
    description: str
    graph: Callable[[Mapping[str, Any]], ModelGraph]
    placement: PlacementFn | None = None
    stage_experts: Callable[[Mapping[str, Any]], HostCallback | None] | None = None
    run: Callable[[list[str]], int] | None = None
    version: str = "0"


@dataclass(frozen=True)
class CommandSpec:
    """A `flare` subcommand a plugin adds (the runtime's own CLI is only a dispatcher).

    `add_arguments(parser)` fills the subcommand's argparse parser; `run(args)`
    returns the exit code: 0 ok, 2 bad usage or input, 1 a failure of the run.
    Names are unique across plugins.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""
