"""Registers `silero-vad` (entry point `flare.models`: silero-vad = flare.models.silero_vad.plugin).

Registration must be cheap: nothing here reads the ONNX file; weights are
converted (once, cached) when an entry point is first built.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Mapping

import numpy as np

from flare.plugin_manager import hookimpl
from flare.specs import ModelSpec

from . import graph as G
from .numpy_reference import CHUNK, CONTEXT, HIDDEN


@lru_cache(maxsize=1)
def graph_weights() -> dict[str, np.ndarray]:
    """Weights in the graph's layout (from the cached safetensors conversion)."""
    from .weights import load_weights

    return G.prepare_weights(load_weights())


def load_weights(config: Mapping[str, Any] | None = None) -> Mapping[str, np.ndarray]:
    """ModelSpec.load_weights: graph weight name -> array."""
    return graph_weights()


def _entry(fn: Callable) -> Callable[[Any, Mapping[str, tuple]], None]:
    def build(b: Any, shapes: Mapping[str, tuple]) -> None:
        fn(b, graph_weights(), shapes)

    build.__doc__ = fn.__doc__
    return build


def prepare(session: Any, **options: Any) -> Any:
    """ModelSpec.prepare: the model's PreparedGraph with default options (for `flare describe`,
    benchmarks). Options go to SileroVad (workspace, placement, block, max_batch)."""
    from .runner import SileroVad

    return SileroVad(session, **options).pg


def run(argv: list[str]) -> int:
    from .cli import main

    return main(argv)


@hookimpl
def flare_models() -> list[ModelSpec]:
    return [ModelSpec(
        name="silero-vad",
        description="Silero VAD v5 (16 kHz): speech probability per 32 ms chunk, speech segments",
        entries={name: _entry(fn) for name, fn in G.ENTRIES.items()},
        load_weights=load_weights,
        placement=None,
        run=run,
        prepare=prepare,
        config={"sample_rate": 16000, "chunk": CHUNK, "context": CONTEXT, "hidden": HIDDEN,
                "example_shapes": {"stream": {"chunk": (1, CHUNK)}, "frontend": {"windows": (32, CHUNK + CONTEXT)},
                                   "recur": {"xproj": (64, 4 * HIDDEN)}}},
        version="5",
    )]
