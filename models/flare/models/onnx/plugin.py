"""Registers the ONNX importer (entry point `flare.models`: onnx = flare.models.onnx.plugin).

It registers no named model: it claims targets. `flare run MODEL.onnx` and
`flare describe MODEL.onnx` come here through the `flare_run_target` and
`flare_describe_target` hooks. Cheap to import: onnx loads only when a
target is run.
"""
from __future__ import annotations

from typing import Any, Callable

from flare.core.plugin_manager import hookimpl


def _is_onnx(target: str) -> bool:
    return target.lower().endswith(".onnx")


@hookimpl
def flare_run_target(target: str) -> Callable[[list[str]], int] | None:
    if not _is_onnx(target):
        return None
    from .cli import run_file

    return lambda argv: run_file(target, argv)


@hookimpl
def flare_describe_target(target: str) -> Callable[[Any], int] | None:
    if not _is_onnx(target):
        return None
    from .cli import describe_file

    return lambda args: describe_file(target, args)
