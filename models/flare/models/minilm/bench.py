"""minilm-l6 as a benchmark workload: batches of sentences in, unit-norm embeddings out.

A request is `batch` sentences (the built-in pool below, or text files with
one sentence per line; requests take consecutive sentences and wrap around),
tokenized inside the timing as a user's call would be. The metric is
throughput in sentences per second.

Peers: `flare` (MiniLM on the configured devices), `numpy` (the hand-written
float32 forward in flare.models.minilm.bench_numpy_peer), `onnxruntime` (an ONNX
graph of the same weights, flare.models.minilm.bench_onnx_peer), `torch` (the same
forward in PyTorch, when torch is importable). Outputs agree within 1e-4 per
embedding component.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from flare.plugins.bench.config import BenchConfig
from flare.plugins.bench.errors import BenchConfigError
from flare.plugins.bench.flare_runner import FlareRunner
from flare.plugins.bench.workload import Metric, Option, Request, Workload

SENTENCES_PER_S = Metric("sentences/s", "sentences", per_work=False)

# A deterministic pool with a spread of lengths (4 to ~60 tokens), so batches are padded as in real use.
BUILTIN_SENTENCES = (
    "The weather is lovely today.",
    "It's so sunny outside!",
    "He drove to the stadium.",
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome, I loved every minute of it and would happily watch it again with friends.",
    "Two dogs are playing in the snow near a frozen lake.",
    "Stock markets fell sharply after the central bank raised interest rates by half a percentage point.",
    "Where is the nearest train station?",
    "Please restart the server before applying the security patch, then check the logs for errors.",
    "A woman is playing the violin.",
    "Quantum computers use qubits, which can represent zero and one at the same time.",
    "The recipe calls for two cups of flour, a pinch of salt, three eggs and a little warm milk.",
    "Children are building a sandcastle on the beach while their parents read.",
    "I forgot my umbrella.",
    "The committee will publish its final report on renewable energy subsidies next spring, after a public consultation.",
    "Cats sleep for most of the day.",
    "A cyclist is riding along a mountain road at sunset.",
    "How do I reset my password?",
    "The museum's new exhibition explores the history of navigation, from ancient star charts to satellite positioning systems.",
    "Fresh bread smells wonderful.",
    "The team won the championship after a dramatic penalty shootout in the final minutes.",
    "An old lighthouse stands on the rocky coast.",
    "Researchers found that regular walking improves memory and reduces the risk of heart disease in older adults.",
    "She is reading a book in the garden.",
    "The flight was delayed by three hours because of a storm over the Atlantic.",
    "Turn left at the second traffic light.",
    "Volcanic eruptions can cool the global climate for several years by releasing sulfur dioxide into the stratosphere.",
    "A chef is slicing vegetables.",
    "The library extended its opening hours during the exam period.",
    "Music helps me concentrate.",
    "Engineers inspected the bridge after the earthquake and declared it safe for traffic.",
)


class MiniLMWorkload(Workload):

    threads_supported = True   # `threads`: the CPU device's threads (FlareRunner)
    model = "minilm-l6"
    metric = SENTENCES_PER_S
    tolerance = 1e-4
    default_requests = 8
    options = {
        "batch": Option(int, 32, "sentences per request (one execute when <= max_batch)", minimum=1,
                        shapes_requests=True),
        "sentences": Option("paths", ("builtin",), "text files with one sentence per line (relative to the "
                            "TOML), or \"builtin\" for the built-in pool", shapes_requests=True, keywords=("builtin",)),
        "max_length": Option(int, 256, "tokens per sentence before truncation", minimum=2, shapes_requests=True),
        "threads": Option(int, 1, "onnxruntime: intra-op threads (the top-level `threads` sets it)", minimum=1),
    }

    def validate(self, config: BenchConfig) -> None:
        from flare.models.minilm.weights import BertConfig

        if config.options["max_length"] > BertConfig.max_positions:
            raise BenchConfigError(f"at most {BertConfig.max_positions} (the model's positions)",
                                   path=config.path, key="options.max_length")

    def requests(self, config: BenchConfig, count: int) -> list[Request]:
        pool: list[str] = []
        for item in config.options["sentences"]:
            if item == "builtin":
                pool += BUILTIN_SENTENCES
                continue
            lines = [ln.strip() for ln in Path(item).read_text(encoding="utf-8").splitlines()]
            pool += [ln for ln in lines if ln]
        if not pool:
            raise BenchConfigError("no sentences (the files are empty)", path=config.path, key="options.sentences")
        batch = config.options["batch"]
        return [Request(r, [pool[(r * batch + j) % len(pool)] for j in range(batch)], float(batch),
                        f"{batch} sentences") for r in range(count)]

    def open_flare(self, config: BenchConfig) -> FlareRunner:
        from flare.models.minilm.runner import MiniLM
        from flare.models.minilm.weights import SafetensorsWeights, load_config

        weights, cfg = SafetensorsWeights(), load_config()
        batch, max_length = config.options["batch"], config.options["max_length"]

        def build(session: Any) -> MiniLM:
            return MiniLM(session, max_batch=batch, max_length=max_length, weights=weights, config=cfg)

        def infer(model: MiniLM, request: Request) -> np.ndarray:
            return model.embed(request.payload)

        return FlareRunner(config, build, infer)

