"""Hook specifications of the runtime: every hook the runtime calls is declared and documented here.

Three kinds, as in pytest:

- *Registration hooks* return lists of frozen specs (`flare_backends`,
  `flare_models`, `flare_cli_commands`). The plugin manager collects them once;
  a duplicate name is a `PluginError`.
- *Extension hooks* let application plugins add extension points of their own
  (`flare_addhooks`, like `pytest_addhooks`): `flare bench` declares
  `flare_bench_workloads`, `flare export` declares `flare_export_adapters`.
  After every plugin is loaded the manager checks that each implemented hook
  is declared somewhere; a misspelled hookimpl is a `PluginError` naming the
  plugin.
- *Observer hooks* are called by `PreparedGraph` after each lifecycle step
  succeeds, with what happened. They must not change results; use them to
  count, time or trace. They are notifications, never the place where the
  work is done, so reading `PreparedGraph` shows the whole flow.

The lifecycle and the device interface a backend implements (`flare.core.backend`):

    PreparedGraph step        Device / PreparedSplit method             observer hook
    prepare (plan, reserve)   Device.alloc, Device.compile(SplitProgram)  flare_graph_prepared
      re-bind after growth    PreparedSplit.rebind (else compile again)
    execute                   Device.write, PreparedSplit.run, read        flare_graph_executed
    reset                     Device.fill_zero of state tensors            flare_graph_reset
    release                   PreparedSplit.release, Buffer.release        flare_graph_released
"""
from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("flare")


# ---------------------------------------------------------------- registration
@hookspec
def flare_backends() -> list:
    """Return the `BackendSpec`s this plugin provides.

    Called once when the plugin manager first lists backends. Names must be
    unique across all plugins; a duplicate is a `PluginError`. A plugin whose
    import or hook raises is reported by `flare backends` and skipped.
    """


@hookspec
def flare_models() -> list:
    """Return the `ModelSpec`s this plugin provides (same rules as backends).

    The runtime reads the spec's `graph`, `placement` and `stage_experts` in
    `Session.prepare_model`, and `run` in `flare run NAME`.
    """


@hookspec
def flare_cli_commands() -> list:
    """Return the `CommandSpec`s (subcommands of `flare`) this plugin adds.

    The runtime's CLI has `backends`, `models`, `run` and `describe`; `bench`,
    `export` and `serve` come from application plugins through this hook.
    Keep the hook cheap: import heavy modules inside `CommandSpec.run`.
    """


@hookspec(firstresult=True)
def flare_run_target(target: str) -> Any:
    """Claim `flare run TARGET` for a target that is not a model name.

    Return a callable `run(argv) -> exit code` when this plugin runs `target`
    (the export plugin claims directories holding an exported core's
    `manifest.json`), else None. The first non-None answer wins.
    """


@hookspec(firstresult=True)
def flare_describe_target(target: str) -> Any:
    """Claim `flare describe TARGET` for a target that is not a model name.

    Return a callable `describe(args) -> exit code` (args: the parsed `describe`
    arguments: `backends`, `option`, `json`) when this plugin describes `target`
    (the ONNX importer claims `*.onnx` files), else None. The first non-None answer wins.
    """


@hookspec(historic=True)
def flare_addhooks(pluginmanager: Any) -> None:
    """Add hook specifications of an application plugin.

    Call `pluginmanager.add_hookspecs(module)`. Historic: plugins registered
    later still see it, so the order in which entry points load does not matter.
    """


# -------------------------------------------------------------------- observers
@hookspec
def flare_graph_prepared(graph: Any, entry: str, shapes: dict, replan: bool, seconds: float) -> None:
    """A new plan of `entry` was built, reserved and compiled for input `shapes`.

    `replan` is True when an execute with new input shapes caused it (the
    PreparedGraph planned again inside `execute`); False for an explicit
    `prepare`. A prepare served from the plan cache is not reported.
    """


@hookspec
def flare_graph_executed(graph: Any, entry: str, seconds: float) -> None:
    """`entry` ran to completion; `seconds` covers input writes, splits and output reads."""


@hookspec
def flare_graph_reset(graph: Any) -> None:
    """Per-request state of `graph` was zeroed (memory and captures kept)."""


@hookspec
def flare_graph_released(graph: Any) -> None:
    """`graph` released its captures, persistent buffers and workspace reference."""
