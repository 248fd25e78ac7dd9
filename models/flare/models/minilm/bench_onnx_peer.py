"""all-MiniLM-L6-v2 in onnxruntime: the `onnxruntime` peer of the minilm-l6 bench workload.

The ONNX graph is built from the wheel's safetensors with standard ops
(`flare.models.minilm.onnx_export`, cached after the first build) and run with
ORT_ENABLE_ALL and `threads` intra-op threads; batches are padded to their
longest sentence, as sentence-transformers does. Its embeddings equal Flare's
within 1e-5 (tests/test_minilm_onnx.py).
"""
from __future__ import annotations

import numpy as np

from flare.plugins.bench.peer_runner import PeerRunner
from flare.plugins.bench.workload import Peer


class MiniLMOnnxRunner(PeerRunner):
    def __init__(self, threads: int = 1, max_length: int = 256):
        import onnxruntime as ort

        from .onnx_export import session

        self.session = session(threads)
        self.max_length = int(max_length)
        self.description = (f"onnxruntime {ort.__version__} CPU, {threads} intra-op thread(s), ONNX graph of the "
                            f"safetensors (standard ops, ORT_ENABLE_ALL), padded to the longest sentence")

    def compute(self, payload) -> np.ndarray:
        from .onnx_export import embed
        from .tokenize import encode, pad_batch

        tokens = encode(list(payload), self.max_length)
        batch = pad_batch(tokens)
        return embed(self.session, batch.ids, batch.lengths)


PEER = Peer("onnxruntime", "onnxruntime on an ONNX graph built from the same safetensors "
            "(flare.models.minilm.bench_onnx_peer)", module="onnxruntime", model="minilm-l6",
            open=lambda config: MiniLMOnnxRunner(config.options["threads"], config.options["max_length"]),
            takes_threads=True)
