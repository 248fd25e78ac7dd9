"""The `moe-lm` model plugin: registers the ModelSpec with Flare's plugin manager.

Entry point (pyproject): `[project.entry-points."flare.models"] moe-lm = "flare.models.moe_lm.plugin"`.
The heavy pieces import lazily so `flare models` stays quick.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from flare.graph import GraphBuilder
from flare.plugin_manager import hookimpl
from flare.specs import ModelSpec

from .config import SIZES, MoeConfig, get_config
from .graph import GraphSpec, build_step
from .placement import Placement
from .staging import ExpertStager


def _prefill(b: GraphBuilder, config: GraphSpec, **shapes: tuple) -> None:
    """`prefill` entry: shapes tokens/pos/kv_rows [T], mask [T, kv_rows], out_rows [B]."""
    build_step(b, config, shapes)


def _decode(b: GraphBuilder, config: GraphSpec, **shapes: tuple) -> None:
    """`decode` entry: one token per sequence, logits of every token."""
    build_step(b, config, {k: v for k, v in shapes.items() if k != "out_rows"})


def load_weights(config: Mapping[str, Any] | MoeConfig | None = None) -> Mapping[str, np.ndarray]:
    """Memory-mapped weights of a size (generated into the cache dir on first use).
    config: a MoeConfig, or a mapping with `size` (default tiny) and `seed`."""
    from . import weights

    if isinstance(config, MoeConfig):
        cfg, seed = config, 0
    else:
        config = dict(config or {})
        cfg, seed = get_config(config.get("size", "tiny")), int(config.get("seed", 0))
    return weights.WeightFile(weights.ensure(cfg, seed), cfg).as_dict()


def prepare(session: Any, **options: Any) -> Any:
    """ModelSpec.prepare: the model's PreparedGraph (`prefill` + `decode`) on `session`, for
    `flare describe` and benchmarks. Options go to `MoeLM.load` (size, experts, cache_mb, ...);
    the graph is released with the session. Use `MoeLM.load` for the full API."""
    from .model import MoeLM

    return MoeLM.load(session=session, **options).graph


def _run(argv: list[str]) -> int:
    from .cli import run
    return run(argv)


SPEC = ModelSpec(
    name="moe-lm",
    description="Mixture-of-experts decoder LM (synthetic weights): expert placement, resident/offload staging, "
                "mixed prefill batches",
    entries={"prefill": _prefill, "decode": _decode, "mixed": _prefill},
    load_weights=load_weights,
    placement=Placement(),
    stage_experts=ExpertStager,
    run=_run,
    prepare=prepare,
    config={"sizes": {name: cfg.to_json() for name, cfg in SIZES.items()}, "default_size": "tiny",
            "api": "flare.models.moe_lm.MoeLM"},
    version="0.1.0",
)


@hookimpl
def flare_models() -> list[ModelSpec]:
    return [SPEC]
