"""The `moe-lm` model plugin: registers the ModelSpec with Flare's plugin manager.

Entry point (pyproject): `[project.entry-points."flare.models"] moe-lm = "flare.models.moe_lm.plugin"`.
The heavy pieces import lazily so `flare models` stays quick.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from flare.core.plugin_manager import hookimpl
from flare.core.specs import ModelGraph, ModelSpec

from .config import SIZES, MoeConfig, get_config
from .graph import OFFLOAD, GraphSpec
from .placement import Placement
from .staging import ExpertStager


def model_graph(options: Mapping[str, Any]) -> ModelGraph:
    """ModelSpec.graph: `prefill`, `decode` and `mixed` entries sharing weights, KV cache and
    expert caches. Options: `graph_spec` (a GraphSpec: config, weights, expert mode; default
    the `size` option's resident weights, generated on first use) and `prefill_chunk`."""
    from .graph import entry_builders, input_shapes

    spec = options.get("graph_spec")
    if spec is None:
        cfg = get_config(options.get("size", "tiny"))
        spec = GraphSpec(cfg, load_weights({"size": cfg.name, "seed": options.get("seed", 0)}))
    cfg = spec.cfg
    chunk = int(options.get("prefill_chunk") or cfg.prefill_chunk)
    shapes = {"prefill": input_shapes(cfg, chunk, 1), "decode": input_shapes(cfg, 1)}
    return ModelGraph(entry_builders(spec), shapes, name=f"moe-lm-{cfg.name}")


def stage_experts(options: Mapping[str, Any]) -> ExpertStager | None:
    """ModelSpec.stage_experts: for an offload `graph_spec`, the callback that copies the
    router's selected experts into the bounded per-layer caches before each expert matmul
    (from the memory-mapped `weight_file`, or a host copy with `expert_source="host"`);
    None when experts are resident."""
    from . import weights

    spec = options.get("graph_spec")
    if spec is None or spec.experts != OFFLOAD:
        return None
    wf = options["weight_file"]
    tensors = {n: wf.tensor(n) for n in wf.names() if weights.is_expert(n)}
    if options.get("expert_source", "mmap") == "host":
        tensors = weights.host_copy(tensors)
    return ExpertStager(spec.cfg, tensors, spec.slots, trace=bool(options.get("trace", False)))


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


def _run(argv: list[str]) -> int:
    from .cli import run
    return run(argv)


SPEC = ModelSpec(
    name="moe-lm",
    description="Mixture-of-experts decoder LM (synthetic weights): expert placement, resident/offload staging, "
                "mixed prefill batches",
    graph=model_graph,
    placement=Placement(),
    stage_experts=stage_experts,
    run=_run,
    version="0.1.0",
)


@hookimpl
def flare_models() -> list[ModelSpec]:
    return [SPEC]


@hookimpl(optionalhook=True)   # declared by an application plugin, which may be absent
def flare_bench_workloads() -> list:
    from .bench import MoeLMWorkload
    from .bench_serving import MoeServingWorkload

    return [MoeLMWorkload, MoeServingWorkload]


@hookimpl(optionalhook=True)   # declared by an application plugin, which may be absent
def flare_export_adapters() -> list:
    from flare.plugins.export.adapters import AdapterSpec

    from .export import MoeLmAdapter

    return [AdapterSpec("moe-lm", MoeLmAdapter, tokenizer=chat_tokenizer)]


# moe-lm's chat format: role markers as plain text, the assistant's turn ends at <eos>. The weights are
# random, so the answers are noise; the template exists so that chat serving is testable end to end.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer(core_dir: Any, manifest: Any) -> Any:
    """`flare serve`'s tokenizer of a moe-lm core: <bos> + UTF-8 bytes, and `CHAT_TEMPLATE`."""
    from flare.plugins.export.serving.tokenizer import ByteTokenizer

    from .config import BOS, EOS

    return ByteTokenizer(CHAT_TEMPLATE, bos=BOS, eos=EOS)
