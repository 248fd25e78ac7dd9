"""Hook specifications: every hook Flare calls is declared and documented here.

Registration hooks return lists of frozen specs. Observer hooks are called
around lifecycle steps and are meant to be implemented as wrappers
(`@hookimpl(wrapper=True)`) for timing and tracing; they must not change
results.
"""
from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("flare")


@hookspec
def flare_backends() -> list:
    """Return the `BackendSpec`s this plugin provides.

    Called once when the plugin manager loads plugins. Names must be unique
    across all plugins; a duplicate is a `PluginError`. A plugin whose import or
    hook raises is reported by `flare backends` and skipped.
    """


@hookspec
def flare_models() -> list:
    """Return the `ModelSpec`s this plugin provides (same rules as backends)."""


@hookspec(firstresult=True)
def flare_prepare(graph: Any, entry: str, shapes: dict) -> Any:
    """Lifecycle step: plan and bind `entry` of `graph` for input `shapes`.

    Flare's own core plugin implements it (it does the work, as pytest's
    runner implements `pytest_runtest_call`). Other plugins implement it as a
    wrapper (`@hookimpl(wrapper=True)`) to time or trace: `result = yield`,
    then return `result` unchanged.
    """


@hookspec(firstresult=True)
def flare_execute(graph: Any, entry: str, inputs: dict) -> Any:
    """Lifecycle step: run `entry` with `inputs`, return its outputs dict.

    Implemented by the core plugin; observers wrap it (see `flare_prepare`).
    """


@hookspec(firstresult=True)
def flare_release(graph: Any) -> Any:
    """Lifecycle step: release captures, persistent buffers, then the workspace.

    Implemented by the core plugin; observers wrap it (see `flare_prepare`).
    """
