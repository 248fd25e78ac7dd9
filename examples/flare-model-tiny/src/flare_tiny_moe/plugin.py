"""The module the `flare.models` entry point names: it registers tiny-moe's ModelSpec.

The runtime reads every field itself (`Session.prepare_model`): `graph` for the
entries and their first shapes, `placement` for the scheduler, `stage_experts`
for the graph's `stage_experts` host node. No `run` job: `flare run tiny-moe`
prepares the graph and executes it on zeros or on `--input x=FILE.npy`.
"""
from __future__ import annotations

from typing import Any, Mapping

from flare.core.plugin_manager import hookimpl
from flare.core.specs import ModelGraph, ModelSpec

from . import __version__
from .model import EXPERT_TENSORS, RESIDENT, D_MODEL, TinyConfig, build_forward, placement, weights
from .staging import ExpertStager


def model_graph(options: Mapping[str, Any]) -> ModelGraph:
    """ModelSpec.graph: one entry, `forward`, first prepared for `tokens` rows."""
    cfg = TinyConfig.from_options(options)
    return ModelGraph(entries={"forward": lambda b, shapes: build_forward(b, shapes, cfg)},
                      shapes={"forward": {"x": (cfg.tokens, D_MODEL)}},
                      name=f"tiny-moe-{cfg.experts}")


def stage_experts(options: Mapping[str, Any]) -> ExpertStager | None:
    """ModelSpec.stage_experts: a fresh stager over the host copy of the experts, or
    None when the experts are resident (the graph then has no `stage_experts` node)."""
    cfg = TinyConfig.from_options(options)
    if cfg.experts == RESIDENT:
        return None
    w = weights(cfg.seed)
    return ExpertStager(cfg, {name: w[name] for name in EXPERT_TENSORS})


SPEC = ModelSpec(
    name="tiny-moe",
    description="example plugin: one MoE layer, experts placed on the last device and staged from host memory",
    graph=model_graph,
    placement=placement,
    stage_experts=stage_experts,
    version=__version__,
)


@hookimpl
def flare_models() -> list[ModelSpec]:
    return [SPEC]
