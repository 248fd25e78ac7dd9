"""all-MiniLM-L6-v2 in plain float32 NumPy: the hand-written peer Flare's graph is measured against.

Written from the BERT definition (HF `BertModel`, then sentence-transformers'
mean pooling and Normalize), the way a NumPy user would write it: one
`x @ W.T + b` per linear layer, softmax attention per head with an additive
padding mask, exact (erf) GELU, float32 throughout. It shares only the
weights file and the tokenizer with Flare (both found through
`flare.models.minilm.weights`/`tokenize`, which read files and build no
graph), so speed and outputs are an independent measurement.

Unlike `flare.models.minilm.numpy_reference` (float64, an accuracy oracle),
this is a speed peer: same precision as the graph, batches padded to their
longest sentence as sentence-transformers does.

GELU's erf comes from SciPy when it is importable, else from a float32
polynomial (Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7); `ERF_SOURCE` says
which, and the benchmark prints it.
"""
from __future__ import annotations

from math import sqrt
from typing import Mapping, Sequence

import numpy as np

from flare.plugins.bench.peer_runner import PeerRunner
from flare.plugins.bench.workload import Peer

try:
    from scipy.special import erf as _erf

    ERF_SOURCE = "scipy.special.erf"
except ImportError:  # SciPy is optional
    _erf = None
    ERF_SOURCE = "A&S 7.1.26 polynomial"


def erf(x: np.ndarray) -> np.ndarray:
    """erf(x) elementwise, float32 in and out."""
    if _erf is not None:
        return _erf(x)
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + np.float32(0.3275911) * a)
    poly = t * (np.float32(0.254829592) + t * (np.float32(-0.284496736) + t * (np.float32(1.421413741)
           + t * (np.float32(-1.453152027) + t * np.float32(1.061405429)))))
    return (s * (1.0 - poly * np.exp(-a * a))).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    return np.float32(0.5) * x * (np.float32(1.0) + erf(x * np.float32(1.0 / sqrt(2.0))))


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(-1, keepdims=True)
    return xc / np.sqrt(var + np.float32(eps)) * g + b


def softmax(s: np.ndarray) -> np.ndarray:
    s = np.exp(s - s.max(-1, keepdims=True))
    return s / s.sum(-1, keepdims=True)


class MiniLMNumpy:
    """Weights in memory; `embed(sentences)` -> unit-norm embeddings [n, hidden] float32."""

    def __init__(self, weights: Mapping[str, np.ndarray] | None = None, config=None, max_length: int = 256):
        from flare.models.minilm.weights import SafetensorsWeights, load_config

        self.cfg = config or load_config()
        if weights is None:   # read here, not from a process-wide cache, so the peer's memory is its own
            files = SafetensorsWeights()
            weights = {k: files.get(k) for k in files.shapes if k != "embeddings.position_ids"}
        self.w = {k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}
        self.max_length = int(max_length)

    def encode(self, ids: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
        """ids [B, L] right padded, true lengths -> embeddings [B, hidden]."""
        w, cfg = self.w, self.cfg
        B, L = ids.shape
        H, D = cfg.heads, cfg.hidden // cfg.heads
        keep = (np.arange(L)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)     # [B, L]
        bias = ((keep - 1.0) * np.float32(1e30))[:, None, None, :]                           # 0 or -1e30
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:L] \
            + w["embeddings.token_type_embeddings.weight"][0]
        x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], cfg.layer_norm_eps)
        scale = np.float32(1.0 / sqrt(D))
        for i in range(cfg.layers):
            p = f"encoder.layer.{i}."

            def lin(t: np.ndarray, name: str) -> np.ndarray:
                return t @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            q = lin(x, "attention.self.query").reshape(B, L, H, D).transpose(0, 2, 1, 3)
            k = lin(x, "attention.self.key").reshape(B, L, H, D).transpose(0, 2, 1, 3)
            v = lin(x, "attention.self.value").reshape(B, L, H, D).transpose(0, 2, 1, 3)
            a = softmax(q @ k.transpose(0, 1, 3, 2) * scale + bias)
            ctx = (a @ v).transpose(0, 2, 1, 3).reshape(B, L, H * D)
            x = layer_norm(x + lin(ctx, "attention.output.dense"), w[p + "attention.output.LayerNorm.weight"],
                           w[p + "attention.output.LayerNorm.bias"], cfg.layer_norm_eps)
            y = lin(gelu(lin(x, "intermediate.dense")), "output.dense")
            x = layer_norm(x + y, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"],
                           cfg.layer_norm_eps)
        pooled = (x * keep[:, :, None]).sum(1) / keep.sum(1, keepdims=True)
        return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(np.float32)

    def embed(self, sentences: Sequence[str]) -> np.ndarray:
        """Tokenize (truncating at max_length), pad to the longest sentence, encode."""
        from flare.models.minilm.tokenize import encode, pad_batch

        batch = pad_batch(encode(list(sentences), self.max_length))
        return self.encode(batch.ids, batch.lengths)


class MiniLMNumpyRunner(PeerRunner):
    """The `numpy` peer of the minilm-l6 workload."""

    def __init__(self, max_length: int = 256):
        self.model = MiniLMNumpy(max_length=max_length)
        self.description = f"hand-written float32 NumPy {np.__version__} forward (erf: {ERF_SOURCE})"

    def compute(self, payload):
        return self.model.embed(payload)


PEER = Peer("numpy", "hand-written float32 NumPy forward (flare.models.minilm.bench_numpy_peer)", model="minilm-l6",
         open=lambda config: MiniLMNumpyRunner(config.options["max_length"]))
