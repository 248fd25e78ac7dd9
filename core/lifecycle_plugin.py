"""Flare's own implementation of the lifecycle hooks.

Registered first by the plugin manager; it does the work, so observer plugins
can wrap `flare_prepare`, `flare_execute` and `flare_release` (as pytest's
runner implements `pytest_runtest_call` and plugins wrap it).
"""
from __future__ import annotations

from typing import Any

from .plugin_manager import hookimpl


@hookimpl(trylast=True)
def flare_prepare(graph: Any, entry: str, shapes: dict) -> Any:
    return graph._prepare_impl(entry, shapes)


@hookimpl(trylast=True)
def flare_execute(graph: Any, entry: str, inputs: dict) -> Any:
    return graph._execute_impl(entry, inputs)


@hookimpl(trylast=True)
def flare_release(graph: Any) -> Any:
    graph._release_impl()
    return True
