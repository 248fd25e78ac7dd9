"""silero-vad peers: onnxruntime on the wheel's ONNX file, and the plugin's NumPy forward.

Both serve a request (a whole 16 kHz clip) from zero state and return the
per-chunk speech probabilities, like `SileroVad.speech_probs`.
"""
from __future__ import annotations

import numpy as np

from flare.plugins.bench.peer_runner import PeerRunner
from flare.plugins.bench.workload import Peer

SAMPLE_RATE = 16000
CHUNK = 512      # new samples per model call
CONTEXT = 64     # samples carried over from the previous call


class OnnxRuntimeRunner(PeerRunner):
    """silero_vad.onnx on onnxruntime's CPU provider, chunk by chunk with carried state."""

    def __init__(self, threads: int = 1):
        import onnxruntime as ort

        from flare.models.silero_vad.weights import onnx_path

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(onnx_path()), sess_options=opts, providers=["CPUExecutionProvider"])
        self.description = f"onnxruntime {ort.__version__} CPU, {threads} intra-op thread(s), per-chunk calls"

    def compute(self, payload) -> np.ndarray:
        audio = np.asarray(payload, np.float32)
        n = max(1, -(-audio.size // CHUNK))
        padded = np.zeros(n * CHUNK, np.float32)
        padded[:audio.size] = audio
        state = np.zeros((2, 1, 128), np.float32)
        context = np.zeros((1, CONTEXT), np.float32)
        sr = np.array(SAMPLE_RATE, dtype=np.int64)
        out = np.empty(n, np.float32)
        for i in range(n):
            x = np.concatenate([context, padded[None, i * CHUNK:(i + 1) * CHUNK]], axis=1)
            prob, state = self.session.run(None, {"input": x, "state": state, "sr": sr})
            out[i] = prob[0, 0]
            context = x[:, -CONTEXT:]
        return out


class NumpyRunner(PeerRunner):
    """The plugin's NumPy forward: batched frontend, sequential LSTM."""

    def __init__(self) -> None:
        from flare.models.silero_vad.weights import load_weights

        self.weights = load_weights()
        self.description = f"NumPy {np.__version__} forward (flare.models.silero_vad.numpy_reference)"

    def compute(self, payload) -> np.ndarray:
        from flare.models.silero_vad.numpy_reference import speech_probs

        return speech_probs(self.weights, payload)



PEERS = [
    Peer("onnxruntime", "silero_vad.onnx on onnxruntime, one call per 512-sample chunk", "onnxruntime",
         model="silero-vad", open=lambda config: OnnxRuntimeRunner(config.options["threads"]), takes_threads=True),
    Peer("numpy", "the plugin's plain NumPy forward (numpy_reference.py)", model="silero-vad",
         open=lambda config: NumpyRunner()),
]
