"""A pure-NumPy forward of a GGUF llama/Mixtral decoder: the oracle the Flare graph is checked against.

Written from the model definition (llama.cpp's `llm_build_llama`), not from
the graph: float64 throughout, one sequence, full causal attention (no KV
cache, no mask rows, no staging), grouped-query heads by repetition. The
weights are the file's own, dequantized to float32 by `gguf.quants` (llama.cpp's
Python implementation, independent of every Flare kernel) one layer at a time,
so the oracle sees exactly the numbers the quantized kernels approximate.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .config import LMConfig


def dequantized(tensor: np.ndarray) -> np.ndarray:
    """A Flare weight (block tensor or float) as float64 weights, by gguf.quants."""
    from flare.core.ops.quant import as_float

    return as_float(np.asarray(tensor))


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_pairs(x: np.ndarray, base: float, positions: np.ndarray) -> np.ndarray:
    """x [T, H, D], ggml's normal RoPE: adjacent pairs (x[2i], x[2i+1]) turn by pos * base^(-2i/D)."""
    d = x.shape[-1]
    ang = positions[:, None].astype(np.float64) * base ** (-2.0 * np.arange(d // 2) / d)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def forward(cfg: LMConfig, tensor: Callable[[str], np.ndarray], token_ids: Sequence[int]) -> np.ndarray:
    """Logits [T, vocab] (float64) of every position of `token_ids`, starting at position 0."""
    ids = np.asarray(token_ids, np.int64)
    t = ids.size
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pos = np.arange(t)
    emb = dequantized(tensor("token_embd.weight")[np.unique(ids)])
    x = emb[np.searchsorted(np.unique(ids), ids)]
    causal = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(cfg.n_layers):
        w = lambda n: dequantized(tensor(f"blk.{i}.{n}.weight"))  # noqa: E731 - one layer at a time
        h = _rms(x, w("attn_norm"), cfg.norm_eps)
        q = rope_pairs((h @ w("attn_q").T).reshape(t, nh, hd), cfg.rope_base, pos)
        k = rope_pairs((h @ w("attn_k").T).reshape(t, nkv, hd), cfg.rope_base, pos)
        v = (h @ w("attn_v").T).reshape(t, nkv, hd)
        k = np.repeat(k, cfg.group, axis=1)           # query head j uses KV head j // group
        v = np.repeat(v, cfg.group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + causal
        att = np.einsum("hts,shd->thd", _softmax(scores), v).reshape(t, nh * hd)
        x = x + att @ w("attn_output").T
        h = _rms(x, w("ffn_norm"), cfg.norm_eps)
        if cfg.is_moe:
            x = x + _moe(cfg, w, h)
        else:
            g, u = h @ w("ffn_gate").T, h @ w("ffn_up").T
            x = x + (g / (1.0 + np.exp(-g)) * u) @ w("ffn_down").T
    h = _rms(x, dequantized(tensor("output_norm.weight")), cfg.norm_eps)
    head = dequantized(tensor("token_embd.weight" if cfg.tied_head else "output.weight"))
    return h @ head.T


def _moe(cfg: LMConfig, w: Callable[[str], np.ndarray], h: np.ndarray) -> np.ndarray:
    probs = _softmax(h @ w("ffn_gate_inp").T)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, : cfg.top_k]
    gates = np.take_along_axis(probs, top, -1)
    gates /= gates.sum(-1, keepdims=True)
    gate_e, up_e, down_e = w("ffn_gate_exps"), w("ffn_up_exps"), w("ffn_down_exps")
    y = np.zeros_like(h)
    for tok in range(h.shape[0]):
        for j, e in enumerate(top[tok]):
            g, u = gate_e[e] @ h[tok], up_e[e] @ h[tok]
            y[tok] += gates[tok, j] * (down_e[e] @ (g / (1.0 + np.exp(-g)) * u))
    return y


def kl_top1(ref_logits: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """(mean KL(ref || model) in nats, top-1 agreement) over rows."""
    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = np.asarray(z, np.float64)
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    kl = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    agree = float((ref_logits.argmax(-1) == np.asarray(logits).argmax(-1)).mean())
    return kl, agree
