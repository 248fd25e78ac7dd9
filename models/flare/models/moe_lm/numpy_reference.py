"""A pure-NumPy forward of the MoE decoder, written from the model definition, not
from the graph: the independent oracle the Flare graph is checked against.

Float64 throughout, one sequence, full causal attention (no KV cache, no
mask tricks, no staging). Returns logits of every position and each layer's
router choices, so tests can also check which experts staging copied.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from .config import MoeConfig


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, base: float) -> np.ndarray:
    """x [T, H, D], neox halves, positions 0..T-1."""
    t, _, d = x.shape
    half = d // 2
    ang = np.arange(t, dtype=np.float64)[:, None] * base ** (-2.0 * np.arange(half) / d)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def forward(cfg: MoeConfig, tensors: Mapping[str, np.ndarray], token_ids: Sequence[int]
            ) -> tuple[np.ndarray, list[np.ndarray]]:
    """(logits [T, vocab] float64, router top-k ids [T, k] per layer)."""
    w = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    ids = np.asarray(token_ids, np.int64)
    t = ids.size
    nh, hd = cfg.n_heads, cfg.head_dim
    x = w["tok_emb"][ids]
    causal = np.triu(np.full((t, t), -np.inf), 1)
    routes = []
    for i in range(cfg.n_layers):
        h = _rms(x, w[f"L{i}.attn_norm"], cfg.norm_eps)
        q = _rope((h @ w[f"L{i}.wq"].T).reshape(t, nh, hd), cfg.rope_base)
        k = _rope((h @ w[f"L{i}.wk"].T).reshape(t, nh, hd), cfg.rope_base)
        v = (h @ w[f"L{i}.wv"].T).reshape(t, nh, hd)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + causal
        att = np.einsum("hts,shd->thd", _softmax(scores), v).reshape(t, nh * hd)
        x = x + att @ w[f"L{i}.wo"].T

        h = _rms(x, w[f"L{i}.ffn_norm"], cfg.norm_eps)
        probs = _softmax(h @ w[f"L{i}.router"].T + w[f"L{i}.router_bias"])
        top = np.argsort(-probs, axis=-1, kind="stable")[:, : cfg.top_k]
        routes.append(top.astype(np.int32))
        gates = np.take_along_axis(probs, top, -1)
        gates /= gates.sum(-1, keepdims=True)
        y = np.zeros_like(x)
        for tok in range(t):
            for j, e in enumerate(top[tok]):
                g = w[f"L{i}.experts.gate"][e] @ h[tok]
                u = w[f"L{i}.experts.up"][e] @ h[tok]
                a = g / (1.0 + np.exp(-g)) * u
                y[tok] += gates[tok, j] * (w[f"L{i}.experts.down"][e] @ a)
        x = x + y
    h = _rms(x, w["out_norm"], cfg.norm_eps)
    return h @ w["lm_head"].T, routes
