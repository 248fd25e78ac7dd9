"""all-MiniLM-L6-v2 as a Flare graph: BERT encoder, masked mean pooling, L2 normalisation.

One entry, `embed`: inputs `ids` [B, L] i32 (right padded with 0) and `mask`
[B, 1, 1, L] additive (0 for tokens, MASK_NEG for padding); optionally
`tokens` [T] and `spread` [B, L] i32 (`token_layout`), which run the dense
layers on the real tokens only. The mask is the
only thing that knows about padding: attention adds it to the scores, and the
pooling weights are recovered from it exactly (MASK_NEG is -2**30, so
mask * 2**-30 + 1 is exactly 1 or 0). Output `embeddings` [B, 384], unit norm.

Nodes are named `encoder/...` (embeddings and the six layers) and `head/...`
(pooling and normalisation), weights `encoder/<safetensors name>`, so a
placement callback can put the two stages on different devices.
"""
from __future__ import annotations

from math import sqrt
from typing import Callable, Mapping

import numpy as np

from flare.core.graph import GraphBuilder, Tensor

from .tokenize import MASK_NEG
from .weights import BertConfig

WeightSource = Callable[[str], "np.ndarray | Callable[[], np.ndarray]"]


class _Weights:
    """Declares `encoder/<name>` weights on first use, with lazy loaders when given."""

    def __init__(self, b: GraphBuilder, source, shapes: Mapping[str, tuple]):
        self._b, self._src, self._shapes, self._t = b, source, shapes, {}

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._t:
            data = self._src(name)
            if isinstance(data, np.ndarray):
                self._t[name] = self._b.weight(f"encoder/{name}", data)
            else:
                self._t[name] = self._b.weight(f"encoder/{name}", data, shape=self._shapes[name], dtype="f32")
        return self._t[name]


def _linear(b: GraphBuilder, w: _Weights, x: Tensor, name: str) -> Tensor:
    return b.add(b.matmul(x, w[name + ".weight"], transpose_b=True), w[name + ".bias"])


def _layer_norm(b: GraphBuilder, w: _Weights, x: Tensor, name: str, eps: float) -> Tensor:
    return b.add(b.mul(b.layer_norm(x, eps=eps), w[name + ".weight"]), w[name + ".bias"])


def encoder(b: GraphBuilder, w: _Weights, ids: Tensor, mask: Tensor, cfg: BertConfig,
            tokens: Tensor | None = None, spread: Tensor | None = None) -> Tensor:
    """Nodes named `encoder/...` (see `_encoder`)."""
    with b.scope("encoder"):
        return _encoder(b, w, ids, mask, cfg, tokens, spread)


def _encoder(s: GraphBuilder, w: _Weights, ids: Tensor, mask: Tensor, cfg: BertConfig,
             tokens: Tensor | None, spread: Tensor | None) -> Tensor:
    """ids [B, L], mask [B, 1, 1, L] -> last hidden states [B, L, hidden].

    With `tokens` [T] (the flat position b*L + l of each real token, then fillers) and `spread`
    [B, L] (the token index of each position; padding points at any token, its key is masked
    and its row never gathered back), every per-token layer runs on the T real tokens only
    and just attention sees the padded [B, L] layout: a batch of sentences of unequal length
    stops paying the dense layers for its padding."""
    B, L = ids.shape
    H, D = cfg.heads, cfg.head_dim
    pos = s.slice(w["embeddings.position_embeddings.weight"], axis=0, start=0, stop=L)
    typ = s.slice(w["embeddings.token_type_embeddings.weight"], axis=0, start=0, stop=1)  # segment 0 only
    x = s.add(s.add(s.get_rows(w["embeddings.word_embeddings.weight"], ids), pos), typ)
    if tokens is not None:
        x = s.get_rows(s.reshape(x, shape=(B * L, cfg.hidden)), tokens)           # [T, hidden]
    x = _layer_norm(s, w, x, "embeddings.LayerNorm", cfg.layer_norm_eps)

    def heads(t: Tensor) -> Tensor:  # [B, L, H*D] (or [T, H*D] spread to it) -> [B, H, L, D]
        if spread is not None:
            t = s.get_rows(t, spread)
        return s.permute(s.reshape(t, shape=(B, L, H, D)), axes=(0, 2, 1, 3))

    for i in range(cfg.layers):
        p = f"encoder.layer.{i}."
        q = heads(_linear(s, w, x, p + "attention.self.query"))
        k = heads(_linear(s, w, x, p + "attention.self.key"))
        v = heads(_linear(s, w, x, p + "attention.self.value"))
        probs = s.softmax(s.matmul(q, k, transpose_b=True), mask, scale=1.0 / sqrt(D))  # [B, H, L, L]
        ctx = s.contiguous(s.permute(s.matmul(probs, v), axes=(0, 2, 1, 3)))   # [B, L, H, D]
        if tokens is not None:
            ctx = s.get_rows(s.reshape(ctx, shape=(B * L, H * D)), tokens)        # [T, H*D]
        else:
            ctx = s.reshape(ctx, shape=(B, L, H * D))
        x = _layer_norm(s, w, s.add(x, _linear(s, w, ctx, p + "attention.output.dense")),
                        p + "attention.output.LayerNorm", cfg.layer_norm_eps)
        y = _linear(s, w, s.gelu(_linear(s, w, x, p + "intermediate.dense")), p + "output.dense")
        x = _layer_norm(s, w, s.add(x, y), p + "output.LayerNorm", cfg.layer_norm_eps)
    return s.get_rows(x, spread) if spread is not None else x


def pool_normalize(b: GraphBuilder, hidden: Tensor, mask: Tensor) -> Tensor:
    """Mean over unmasked tokens, then divide by the L2 norm: [B, L, E] -> [B, E]."""
    with b.scope("head"):
        return _pool_normalize(b, hidden, mask)


def _pool_normalize(s: GraphBuilder, hidden: Tensor, mask: Tensor) -> Tensor:
    B, L, E = hidden.shape
    keep = s.scale(s.reshape(mask, shape=(B, 1, L)), scale=-1.0 / MASK_NEG, bias=1.0)  # exactly 1 or 0
    total = s.matmul(keep, hidden)                                                         # [B, 1, E]
    mean = s.reshape(s.div(total, s.sum(keep, axis=-1, keepdims=True)), shape=(B, E))
    norm = s.sqrt(s.sum(s.sqr(mean), axis=-1, keepdims=True))                               # [B, 1]
    return s.div(mean, norm)  # not a view, so the output needs no extra (unscoped) copy


def build_embed(b: GraphBuilder, source: WeightSource, shapes_of_weights: Mapping[str, tuple],
                cfg: BertConfig, shapes: Mapping[str, tuple]) -> None:
    """`embed` entry: ids [B, L] i32 + mask [B, 1, 1, L] -> embeddings [B, hidden]."""
    B, L = shapes["ids"]
    if L > cfg.max_positions:
        raise ValueError(f"sequence length {L} exceeds the model's {cfg.max_positions} positions")
    ids = b.input("ids", (B, L), dtype="i32")
    mask = b.input("mask", shapes.get("mask", (B, 1, 1, L)))
    tokens = spread = None
    if "tokens" in shapes:  # token-packed: see encoder()
        tokens = b.input("tokens", shapes["tokens"], dtype="i32")
        spread = b.input("spread", (B, L), dtype="i32")
    w = _Weights(b, source, shapes_of_weights)
    b.output("embeddings", pool_normalize(b, encoder(b, w, ids, mask, cfg, tokens, spread), mask))
