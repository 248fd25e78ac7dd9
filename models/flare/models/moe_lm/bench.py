"""moe-lm as a benchmark workload: prompts in, greedy continuations out; tokens per second.

This is the extension point for the mixture-of-experts configurations:
`experts = "resident"` vs `"offload"` (with `cache_mb`, `expert_source`,
`prefetch`) are options of this kind, so `flare bench resident.toml
offload.toml` compares them with the shared harness. A request is one prompt
(byte tokens, truncated to `prompt_tokens`), prefilled and then decoded
greedily for `new_tokens` tokens; its output is the stacked logits of every
chosen token, so a single flipped token shows up as a difference.

Mixed prefill on/off is a property of an exported core's catalog and of a
serving loop, so it is its own kind: `moe-lm-serving` (workloads/moe_serving.py)
serves a concurrent workload from a core loaded with or without mixed programs.

The entry points share the KV cache, so `workspace_sharing = false` is refused
(`entries_separable = False`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flare.plugins.bench.config import BenchConfig
from flare.plugins.bench.flare_runner import FlareRunner
from flare.plugins.bench.greedy import greedy_request
from flare.plugins.bench.workload import Metric, Option, Request, Workload, cycle

TOKENS_PER_S = Metric("tokens/s", "tokens", per_work=False)

PROMPTS = (
    "Mixture-of-experts models route every token to a few experts out of many.",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "Offloading keeps the experts on disk and copies the chosen ones per step.",
    "A benchmark compares two configurations on the same requests, in A B B A order.",
)


class _Loaded:
    """MoeLM seen as FlareRunner's model object (`pg` + `release`)."""

    def __init__(self, model: Any):
        self.model = model
        self.pg = model.graph

    def release(self) -> None:
        self.model.release()


class MoeLMWorkload(Workload):

    threads_supported = True   # `threads`: the CPU device's threads (FlareRunner)
    model = "moe-lm"
    metric = TOKENS_PER_S
    tolerance = 1e-4
    default_requests = 4
    entries_separable = False
    options = {
        "size": Option(str, "tiny", "model size (tiny, mid, small; small writes ~400 MB of weights once)",
                       choices=("tiny", "mid", "small"), shapes_requests=True),
        "seed": Option(int, 0, "weights seed", shapes_requests=True),
        "experts": Option(str, "resident", "resident: expert weights on the device; offload: a bounded device "
                          "cache filled per step", choices=("resident", "offload")),
        "cache_mb": Option(float, 0.0, "offload: expert cache MiB over all layers (0: the size's default)",
                           minimum=0.0),
        "expert_source": Option(str, "mmap", "offload: where experts come from", choices=("mmap", "host")),
        "prefetch": Option(int, 0, "offload: experts per token to guess and copy ahead (0: off)", minimum=0),
        "prompt_tokens": Option(int, 48, "prompt tokens per request (prompts are truncated)", minimum=1,
                                shapes_requests=True),
        "new_tokens": Option(int, 16, "greedy tokens generated per request", minimum=1, shapes_requests=True),
    }

    def requests(self, config: BenchConfig, count: int) -> list[Request]:
        from flare.models.moe_lm import encode

        n = config.options["prompt_tokens"]
        prompts = [encode(p)[:n] for p in PROMPTS]
        return [Request(i, ids, float(len(ids) + config.options["new_tokens"]), f"{len(ids)}-token prompt")
                for i, ids in enumerate(cycle(prompts, count))]

    def open_flare(self, config: BenchConfig) -> Any:
        from flare.models.moe_lm import MoeLM

        o = config.options
        new_tokens = o["new_tokens"]

        def build(session: Any) -> _Loaded:
            offload = o["experts"] == "offload"
            return _Loaded(MoeLM.load(o["size"], experts=o["experts"], session=session, seed=o["seed"],
                                      cache_mb=(o["cache_mb"] or None) if offload else None,
                                      expert_source=o["expert_source"], prefetch=o["prefetch"] if offload else 0))

        def infer(loaded: _Loaded, request: Request) -> tuple[np.ndarray, dict[str, float]]:
            return greedy_request(loaded.model, request.payload, new_tokens)

        return FlareRunner(config, build, infer)
