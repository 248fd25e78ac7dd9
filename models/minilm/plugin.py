"""Registers `minilm-l6` (entry point `flare.models`: minilm-l6 = flare.models.minilm.plugin).

Registration is cheap: the config and tensor shapes are read when an entry
point is first built; tensor data when a device uploads it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

from flare.plugin_manager import hookimpl
from flare.specs import ModelSpec


@lru_cache(maxsize=1)
def _sources():
    from .weights import SafetensorsWeights, load_config

    return SafetensorsWeights(), load_config()


def build_embed(b: Any, shapes: Mapping[str, tuple]) -> None:
    """`embed`: ids [B, L] i32 + additive mask [B, 1, 1, L] -> embeddings [B, 384]."""
    from .graph import build_embed as build

    weights, cfg = _sources()
    build(b, weights.loader, weights.shapes, cfg, shapes)


def load_weights(config: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """ModelSpec.load_weights: graph weight name -> zero-argument loader (lazy)."""
    weights, _ = _sources()
    return {f"encoder/{k}": weights.loader(k) for k in weights.shapes if k != "embeddings.position_ids"}


def prepare(session: Any, **options: Any) -> Any:
    """ModelSpec.prepare: the model's PreparedGraph with default options (for `flare describe`,
    benchmarks). Options go to MiniLM (workspace, placement, max_batch, max_length)."""
    from .runner import MiniLM

    return MiniLM(session, **options).pg


def run(argv: list[str]) -> int:
    from .cli import main

    return main(argv)


@hookimpl
def flare_models() -> list[ModelSpec]:
    return [ModelSpec(
        name="minilm-l6",
        description="all-MiniLM-L6-v2 sentence embeddings (BERT, 6 layers, 384-d, mean pooling, L2 norm)",
        entries={"embed": build_embed},
        load_weights=load_weights,
        placement=None,
        run=run,
        prepare=prepare,
        config={"hidden": 384, "layers": 6, "heads": 12, "max_seq_length": 256,
                "example_shapes": {"embed": {"ids": (1, 16), "mask": (1, 1, 1, 16)}}},
        version="1",
    )]
