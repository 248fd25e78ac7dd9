"""GGUF models as a benchmark workload: decode and prefill tokens per second.

A request is a fixed English prompt (tokenized by the file's tokenizer,
truncated to `prompt_tokens`), prefilled in chunks of `prefill_chunk`, then
decoded greedily for `new_tokens` tokens (`count` says which tokens are the
work: bench/configs/smollm2_prefill_*.toml count a 128-token prompt,
smollm2_decode_*.toml 32 decoded tokens after an 8-token prompt); its output is the stacked logits
of every chosen token, so configurations are compared on identical work and
a flipped token shows. `flare bench smollm2_cpu.toml smollm2_vulkan.toml`
compares backends; llama.cpp as a peer comes with its own runner. MoE files take
`experts` (resident / offload), `cache_mb` and `prefetch`; the target `bench-moe`
is a small Mixtral-style file written once into the cache folder
(`testing.ensure_bench_moe`), for bench/configs/gguf_moe_*.toml.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flare.plugins.bench.config import BenchConfig
from flare.plugins.bench.flare_runner import FlareRunner
from flare.plugins.bench.greedy import greedy_request
from flare.plugins.bench.workload import Metric, Option, Request, Workload

TOKENS_PER_S = Metric("tokens/s", "tokens", per_work=False)

TEXT = ("The history of the city begins in the early Middle Ages, when a small settlement grew up around a "
        "crossing of the river. Merchants came to trade wool and salt, and within two centuries the town had a "
        "market, a church of stone and a wall with four gates. Scholars arrived later, drawn by a library that a "
        "wealthy bishop had left to the town, and the first college opened its doors to students from across the "
        "country. Today the old streets are full of visitors who come to see the bridge, the cathedral and the "
        "colleges, and to walk along the river in the evening light.")


class _Loaded:
    """GgufLM seen as FlareRunner's model object (`pg` + `release`)."""

    def __init__(self, lm: Any):
        self.lm = lm
        self.pg = lm.graph

    def release(self) -> None:
        self.lm.release()


def _target(target: str) -> str:
    """`bench-moe` is the benchmark MoE file (written on first use); anything else is GgufLM's target."""
    if target == "bench-moe":
        from .testing import ensure_bench_moe

        return str(ensure_bench_moe())
    return target


class GgufWorkload(Workload):
    model = "gguf"
    metric = TOKENS_PER_S
    tolerance = 1e-3
    default_requests = 2
    entries_separable = False
    threads_supported = True
    options = {
        "target": Option(str, "smollm2", "a named GGUF model (smollm2), a .gguf path, or bench-moe (a small "
                         "Mixtral-style file written once into the cache folder: testing.BENCH_MOE)",
                         shapes_requests=True),
        "prompt_tokens": Option(int, 128, "prompt tokens per request", minimum=1, shapes_requests=True),
        "new_tokens": Option(int, 16, "greedy tokens decoded per request", minimum=1, shapes_requests=True),
        "prefill_chunk": Option(int, 128, "most tokens per prefill step (power of two)", minimum=1),
        "max_ctx": Option(int, 512, "KV-cache positions", minimum=2),
        "experts": Option(str, "resident", "MoE files: resident experts, or offload to a bounded cache filled "
                          "from the mapped file per step", choices=("resident", "offload")),
        "cache_mb": Option(float, 0.0, "offload: expert cache MiB over all layers (0: a quarter of the experts)",
                           minimum=0.0),
        "prefetch": Option(int, 0, "offload: experts per token of the next layer to guess and copy ahead (0: off)",
                           minimum=0),
        "count": Option(str, "all", "tokens a request's work counts: prefill (prompt tokens; use new_tokens = 1), "
                        "decode (new tokens; use a short prompt) or all", choices=("all", "prefill", "decode")),
    }

    def requests(self, config: BenchConfig, count: int) -> list[Request]:
        from .weights import GGUFModel

        o = config.options
        tok = GGUFModel.open(_target(o["target"]), max_ctx=o["max_ctx"], prefill_chunk=1).tokenizer()
        ids = tok.encode(" ".join([TEXT] * 8))[: o["prompt_tokens"]]
        work = {"all": len(ids) + o["new_tokens"], "prefill": len(ids), "decode": o["new_tokens"]}[o["count"]]
        return [Request(i, ids, float(work), f"{len(ids)}-token prompt, {o['new_tokens']} new")
                for i in range(count)]

    def open_flare(self, config: BenchConfig) -> Any:
        from .model import GgufLM

        o = config.options

        def build(session: Any) -> _Loaded:
            offload = o["experts"] == "offload"
            return _Loaded(GgufLM.load(_target(o["target"]), session=session, max_ctx=o["max_ctx"],
                                       prefill_chunk=o["prefill_chunk"], experts=o["experts"],
                                       cache_mb=(o["cache_mb"] or None) if offload else None,
                                       prefetch=o["prefetch"] if offload else 0))

        def infer(loaded: _Loaded, request: Request) -> tuple[np.ndarray, dict[str, float]]:
            return greedy_request(loaded.lm, request.payload, o["new_tokens"])

        return FlareRunner(config, build, infer)
