"""all-MiniLM-L6-v2 forward in plain NumPy: the independent peer of the Flare graph.

Written from the BERT definition (HF `BertModel` + sentence-transformers mean
pooling + Normalize), sharing only weights and tokenizer with the graph.
"""
from __future__ import annotations

from math import erf, sqrt
from typing import Mapping

import numpy as np

from .weights import BertConfig

_erf = np.vectorize(erf, otypes=[np.float64])


def _layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def _gelu(x: np.ndarray) -> np.ndarray:
    try:
        from scipy.special import erf as fast_erf  # optional, only for speed
    except ImportError:
        fast_erf = _erf
    return 0.5 * x * (1.0 + fast_erf(x / sqrt(2.0)))


def encode(w: Mapping[str, np.ndarray], ids: np.ndarray, lengths: list[int] | tuple[int, ...],
           cfg: BertConfig = BertConfig()) -> np.ndarray:
    """ids [B, L] (right padded), lengths -> L2-normalised sentence embeddings [B, hidden] (float64 math)."""
    B, L = ids.shape
    keep = (np.arange(L)[None, :] < np.asarray(lengths)[:, None]).astype(np.float64)   # [B, L]
    f = {k: v.astype(np.float64) for k, v in w.items() if k != "embeddings.word_embeddings.weight"}
    x = w["embeddings.word_embeddings.weight"][ids].astype(np.float64) \
        + f["embeddings.position_embeddings.weight"][:L] + f["embeddings.token_type_embeddings.weight"][0]
    x = _layer_norm(x, f["embeddings.LayerNorm.weight"], f["embeddings.LayerNorm.bias"], cfg.layer_norm_eps)
    H, D = cfg.heads, cfg.head_dim
    bias = np.where(keep[:, None, None, :] > 0, 0.0, -np.inf)                         # [B, 1, 1, L]
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}."
        lin = lambda t, n: t @ f[p + n + ".weight"].T + f[p + n + ".bias"]  # noqa: E731
        q = lin(x, "attention.self.query").reshape(B, L, H, D).transpose(0, 2, 1, 3)
        k = lin(x, "attention.self.key").reshape(B, L, H, D).transpose(0, 2, 1, 3)
        v = lin(x, "attention.self.value").reshape(B, L, H, D).transpose(0, 2, 1, 3)
        s = q @ k.transpose(0, 1, 3, 2) / sqrt(D) + bias
        s = np.exp(s - s.max(-1, keepdims=True))
        a = s / s.sum(-1, keepdims=True)
        ctx = (a @ v).transpose(0, 2, 1, 3).reshape(B, L, H * D)
        x = _layer_norm(x + lin(ctx, "attention.output.dense"), f[p + "attention.output.LayerNorm.weight"],
                        f[p + "attention.output.LayerNorm.bias"], cfg.layer_norm_eps)
        y = lin(_gelu(lin(x, "intermediate.dense")), "output.dense")
        x = _layer_norm(x + y, f[p + "output.LayerNorm.weight"], f[p + "output.LayerNorm.bias"], cfg.layer_norm_eps)
    pooled = (x * keep[:, :, None]).sum(1) / keep.sum(1, keepdims=True)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
