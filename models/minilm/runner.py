"""MiniLM: all-MiniLM-L6-v2 prepared on a Flare session; sentences in, unit vectors out.

Batches are padded to a bucketed shape (batch: a power of two up to
`max_batch`; length: a multiple of 16 up to `max_length`) so a few cached
plans serve all requests, and a short request after a long one reuses the
long one's memory. Rows added only to fill a batch bucket hold a lone [CLS]
token (never an all-padding row, whose mean pooling would divide by zero);
their embeddings are dropped.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from flare.errors import InputError

if TYPE_CHECKING:
    from flare.graph import Tensor
    from flare.session import Session
    from flare.workspace import GraphWorkspace

from .tokenize import encode, pad_batch
from .weights import BertConfig, SafetensorsWeights, load_config

LENGTH_STEP = 8   # padding granularity: 16 cost 10% in padded tokens, exact lengths overflow the plan cache
CLS_ID = 101


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


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
            length = min(_round_up(max(len(t) for t in part), LENGTH_STEP), _round_up(self.max_length, LENGTH_STEP))
            batch = pad_batch(part + [[CLS_ID]] * (rows - len(part)), length)
            emb = self.pg.execute("embed", ids=batch.ids, mask=batch.mask)["embeddings"]
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
