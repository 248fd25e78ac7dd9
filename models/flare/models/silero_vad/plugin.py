"""Registers `silero-vad` (entry point `flare.models`: silero-vad = flare.models.silero_vad.plugin).

Registration must be cheap: nothing here reads the ONNX file; weights are
converted (once, cached) when an entry point is first built.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from flare.core.plugin_manager import hookimpl
from flare.core.specs import ModelGraph, ModelSpec

from . import graph as G
from .numpy_reference import CHUNK


@lru_cache(maxsize=1)
def graph_weights() -> dict[str, np.ndarray]:
    """Weights in the graph's layout (from the cached safetensors conversion)."""
    from .weights import load_weights

    return G.prepare_weights(load_weights())


def model_graph(options: Mapping[str, Any]) -> ModelGraph:
    """ModelSpec.graph: the two entry points over one weight set. Option: `weights`
    (raw ONNX-named arrays; default the wheel's)."""
    from .runner import MIN_BATCH, WINDOW

    raw = options.get("weights")
    w = G.prepare_weights(raw) if raw is not None else graph_weights()
    entries = {name: (lambda b, shapes, fn=fn: fn(b, w, shapes)) for name, fn in G.ENTRIES.items()}
    shapes = {"stream": {"chunk": (1, CHUNK)}, "offline": {"windows": (MIN_BATCH, WINDOW)}}
    return ModelGraph(entries, shapes, name="silero-vad")


def run(argv: list[str]) -> int:
    from .cli import main

    return main(argv)


SPEC = ModelSpec(
    name="silero-vad",
    description="Silero VAD v5 (16 kHz): speech probability per 32 ms chunk, speech segments",
    graph=model_graph,
    run=run,
    version="5",
)


@hookimpl
def flare_models() -> list[ModelSpec]:
    return [SPEC]


@hookimpl(optionalhook=True)   # declared by an application plugin, which may be absent
def flare_bench_workloads() -> list:
    from .bench import SileroVadWorkload

    return [SileroVadWorkload]


@hookimpl(optionalhook=True)   # declared by an application plugin, which may be absent
def flare_bench_peers() -> list:
    from .bench_peers import PEERS

    return PEERS
