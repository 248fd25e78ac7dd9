"""MiniLM: all-MiniLM-L6-v2 prepared on a Flare session; sentences in, unit vectors out.

Batches are padded to a bucketed shape (batch: a power of two up to
`max_batch`; length: for one sentence exact up to EXACT_LENGTHS tokens, where
most sentences fall, then a multiple of LENGTH_STEP up to `max_length`; for
several, a multiple of LENGTH_STEP, with the dense layers run on the real
tokens only, their count a multiple of TOKEN_STEP: `token_layout`) so a bounded set of
cached plans (PLAN_CACHE per entry, ~0.3 MiB of host objects each; a new shape
costs ~20 ms of planning once) serves all requests, and a short request after a
long one reuses the long one's memory (the arena is the workspace's). Rows added only to fill a batch bucket hold a lone [CLS]
token (never an all-padding row, whose mean pooling would divide by zero);
their embeddings are dropped.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from flare.core.errors import InputError

if TYPE_CHECKING:
    from flare.core.graph import Tensor
    from flare.core.session import Session
    from flare.core.workspace import GraphWorkspace

from .tokenize import encode, pad_batch
from .weights import BertConfig, SafetensorsWeights, load_config

LENGTH_STEP = 8      # padding granularity past EXACT_LENGTHS
EXACT_LENGTHS = 32   # lengths up to this run unpadded: padding to 8 cost ~18% of the rows at batch 1
PLAN_CACHE = 64      # plans kept per entry: every exact length at one or two batch buckets
TOKEN_STEP = 16      # batches of several sentences: real-token count rounded up to this (plan shapes)
CLS_ID = 101


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def token_layout(lengths: Sequence[int], length: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """`tokens` [T] (flat padded position of each real token; T rounded up to `step` with
    fillers at position 0) and `spread` [B, length] (each position's token index; padding -> 0)."""
    spread = np.zeros((len(lengths), length), np.int32)
    flat: list[np.ndarray] = []
    t = 0
    for b, n in enumerate(lengths):
        spread[b, :n] = np.arange(t, t + n, dtype=np.int32)
        flat.append(np.arange(b * length, b * length + n, dtype=np.int32))
        t += n
    tokens = np.zeros(min(_round_up(t, step), len(lengths) * length), np.int32)
    tokens[:t] = np.concatenate(flat)
    return tokens, spread


def bucket_length(n: int, max_length: int) -> int:
    """The padded length of a batch whose longest sentence has n tokens."""
    if n <= EXACT_LENGTHS:
        return n
    return min(_round_up(n, LENGTH_STEP), _round_up(max_length, LENGTH_STEP))


def _pow2(n: int, cap: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return min(size, cap)


class MiniLM:
    """Sentence embeddings on a session. Use as a context manager or call `release()`."""

    def __init__(self, session: "Session", *, workspace: "GraphWorkspace | None" = None,
                 placement: "Callable[[Tensor, list[str]], str | None] | None" = None,
                 max_batch: int = 32, max_length: int | None = None,
                 weights: SafetensorsWeights | None = None, config: BertConfig | None = None):
        self.cfg = config or load_config()
        self.max_batch = int(max_batch)
        self.max_length = int(max_length or self.cfg.max_seq_length)
        if self.max_length > self.cfg.max_positions:
            raise ValueError(f"max_length {self.max_length} exceeds {self.cfg.max_positions} positions")
        self.weights = weights or SafetensorsWeights()
        # the runtime reads the registered ModelSpec (graph, placement) to prepare it
        self.pg = session.prepare_model("minilm-l6", {"weights": self.weights, "config": self.cfg},
                                        workspace=workspace, placement=placement)
        self.pg.max_plans = max(self.pg.max_plans, PLAN_CACHE)

    def release(self) -> None:
        self.pg.release()

    def __enter__(self) -> "MiniLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def embed_tokens(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Embeddings [n, hidden] of already tokenized sentences, one batch bucket at a time."""
        out = np.empty((len(token_ids), self.cfg.hidden), np.float32)
        for lo in range(0, len(token_ids), self.max_batch):
            part = list(token_ids[lo:lo + self.max_batch])
            rows = _pow2(len(part), self.max_batch)
            longest = max(len(t) for t in part)
            if rows == 1:
                batch = pad_batch(part, bucket_length(longest, self.max_length))
                emb = self.pg.execute("embed", ids=batch.ids, mask=batch.mask)["embeddings"]
            else:  # token-packed: dense layers on the real tokens only (graph.encoder)
                length = min(_round_up(longest, LENGTH_STEP), _round_up(self.max_length, LENGTH_STEP))
                batch = pad_batch(part + [[CLS_ID]] * (rows - len(part)), length)
                tokens, spread = token_layout(batch.lengths, length, TOKEN_STEP)
                emb = self.pg.execute("embed_packed", ids=batch.ids, mask=batch.mask, tokens=tokens,
                                      spread=spread)["embeddings"]
            out[lo:lo + len(part)] = emb[:len(part)]
        return out

    def embed(self, sentences: Sequence[str]) -> np.ndarray:
        """Unit-norm sentence embeddings [n, 384] (mean pooling over the attention mask)."""
        if isinstance(sentences, str):
            sentences = [sentences]
        if not sentences:
            raise InputError("minilm-l6: no sentences to embed")
        return self.embed_tokens(encode(sentences, self.max_length))

    def similarity(self, sentences: Sequence[str]) -> np.ndarray:
        """Cosine similarity matrix [n, n] (embeddings are unit vectors, so a dot product)."""
        e = self.embed(sentences)
        return e @ e.T


def split_placement(tensor: "Tensor", devices: list[str]) -> str | None:
    """Encoder (embeddings + layers) on the first device, pooling head on the last."""
    if len(devices) < 2:
        return None
    if tensor.name.startswith("encoder/"):
        return devices[0]
    return devices[-1] if tensor.name.startswith("head/") else None
