"""Registers the ONNX importer (entry point `flare.models`: onnx = flare.models.onnx.plugin).

It registers the `piper` model (text-to-speech through the importer) and claims targets: `flare run MODEL.onnx` and
`flare describe MODEL.onnx` come here through the `flare_run_target` and
`flare_describe_target` hooks. Cheap to import: onnx loads only when a
target is run.
"""
from __future__ import annotations

from typing import Any, Callable

from flare.core.errors import ModelError
from flare.core.plugin_manager import hookimpl
from flare.core.specs import ModelGraph, ModelSpec


def _piper_graph(options: Any) -> ModelGraph:
    raise ModelError("piper runs as an imported ONNX model (its graph is traced per sentence): "
                     "describe the voice file with `flare describe PATH/en_US-joe-medium.onnx`")


def _piper_run(argv: list[str]) -> int:
    from .piper.cli import run

    return run(argv)


PIPER = ModelSpec(name="piper", description="Piper text-to-speech (en_US joe, medium) through the ONNX importer",
                  graph=_piper_graph, run=_piper_run, version="1.0.0")


@hookimpl
def flare_models() -> list[ModelSpec]:
    return [PIPER]


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


@hookimpl(optionalhook=True)   # declared by the bench plugin, which may be absent
def flare_bench_workloads() -> list:
    from .bench import OnnxWorkload

    return [OnnxWorkload]


@hookimpl(optionalhook=True)
def flare_bench_peers() -> list:
    from .bench import PEERS

    return PEERS
