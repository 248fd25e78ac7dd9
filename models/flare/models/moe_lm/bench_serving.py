"""moe-lm served from an exported core: mixed prefill on vs off under a concurrent workload.

One benchmark request is a whole concurrent workload: `sequences` prompts of
different lengths arriving every `gap_ms`, served by the continuous-batching
scheduler (`flare.plugins.export.serving`) on a core loaded with or without its mixed
programs (`mixed_prefill`). Both configurations load the *same* core (given as
`core`, or exported once into the cache directory), so only load-time program
selection differs. Speed is generated tokens per second; each request also
reports the mean time to first token and the number of program launches, which
the report shows for A and B. The output compared is the generated token ids
of every sequence: mixed and separate programs must generate the same text
(their logits differ in rounding only, as their shapes and tuned kernels do).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from flare.plugins.bench.config import BenchConfig
from flare.plugins.bench.errors import BenchConfigError
from flare.plugins.bench.workload import Metric, Option, Request, Timed, Workload

TOKENS_PER_S = Metric("tokens/s", "tokens", per_work=False)

PROMPTS = (
    "Mixture-of-experts models route every token to a few experts out of many.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Offloading keeps experts on disk and copies the chosen ones per step.",
    "A benchmark compares two configurations on the same requests.",
    "Continuous batching admits new requests while others decode.",
    "Short prompt.",
)


def concurrent_requests(n: int, new_tokens: int, gap_s: float) -> list[Any]:
    """`n` serving requests: <bos> plus 16..63 prompt bytes, arriving every `gap_s` seconds."""
    from flare.plugins.export.serving import Request as ServingRequest

    return [ServingRequest(f"r{i:03d}", (256, *PROMPTS[i % len(PROMPTS)].encode()[: 16 + (i * 7) % 48]),
                           new_tokens, round(i * gap_s, 6)) for i in range(n)]


def default_core(size: str) -> Path:
    """The core a configuration without `core` uses: exported once per size into the cache."""
    from flare.plugins.export import cached_core

    return cached_core("moe-lm", f"moe-lm-{size}.core", {"size": size})


class ServingRunner:
    """A loaded, prepared core and its scheduler; `run` serves one concurrent workload."""

    def __init__(self, config: BenchConfig):
        from flare.plugins.export import LoadOptions, load_core
        from flare.plugins.export.runtime import CoreRuntime

        o = config.options
        path = Path(o["core"]) if o["core"] else default_core(o["size"])
        core = load_core(path, LoadOptions(mixed_prefill=o["mixed_prefill"]))
        self.runtime = CoreRuntime(core, devices=list(config.backends))
        self.description = (f"core {path.name}: {len(core.programs)} programs "
                            f"({'with' if o['mixed_prefill'] else 'without'} mixed prefill) on "
                            f"{','.join(config.backends)}, continuous batching")

    def run(self, request: Request) -> Timed:
        from flare.plugins.export.serving import Engine
        from flare.plugins.serve.offline import Batcher

        self.runtime.graph.reset()
        report = Batcher(Engine(self.runtime)).run(list(request.payload))
        tokens = [t for r in sorted(report["per_request"], key=lambda r: r["id"]) for t in r["tokens"]]
        extras = {"time to first token, mean (ms)": 1000.0 * report["ttft_s"]["mean"],
                  "program launches": float(report["launches"])}
        return Timed(np.asarray(tokens, np.float32), float(report["seconds"]), extras)

    def memory_plan(self) -> dict[str, Any] | None:
        return self.runtime.graph.describe()

    def close(self) -> None:
        self.runtime.release()


class MoeServingWorkload(Workload):
    model = "moe-lm-serving"
    metric = TOKENS_PER_S
    tolerance = 0.0            # generated token ids: identical or not
    default_requests = 2
    entries_separable = False
    options = {
        "size": Option(str, "tiny", "model size of the default core (tiny, mid, small)",
                       choices=("tiny", "mid", "small"), shapes_requests=True),
        "core": Option(str, "", "path of an exported core (default: moe-lm SIZE exported once into the cache)",
                       shapes_requests=True),
        "mixed_prefill": Option(bool, True, "load the core with its mixed programs (true) or without (false)"),
        "sequences": Option(int, 8, "requests in one concurrent workload", minimum=1, shapes_requests=True),
        "new_tokens": Option(int, 16, "tokens generated per request", minimum=1, shapes_requests=True),
        "gap_ms": Option(float, 20.0, "time between request arrivals", minimum=0.0, shapes_requests=True),
    }

    def validate(self, config: BenchConfig) -> None:
        if not config.prepared:
            raise BenchConfigError("a served core is prepared once; prepared = false is not supported",
                                   path=config.path, key="prepared")
        if config.peer != "flare":
            raise BenchConfigError("only Flare serves cores", path=config.path, key="peer")

    def requests(self, config: BenchConfig, count: int) -> list[Request]:
        o = config.options
        workload = concurrent_requests(o["sequences"], o["new_tokens"], o["gap_ms"] / 1000.0)
        work = float(o["sequences"] * o["new_tokens"])
        return [Request(i, tuple(workload), work, f"{o['sequences']} concurrent requests") for i in range(count)]

    def open_flare(self, config: BenchConfig) -> ServingRunner:
        return ServingRunner(config)

