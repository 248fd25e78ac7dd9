"""Per-request token choice: greedy, or seeded temperature / top-k / top-p sampling.

The one sampler of token LMs: a served core runs without its model plugin, so
the choice rule lives here, driven only by the manifest (`never`: ids the
contract forbids); `flare run NAME.core`'s batcher, `flare serve` and moe-lm's
own `Sampler` all use it. Work is in
float64 on the host. `probs` gives the distribution a sampled token is drawn
from, which speculative decoding needs for the acceptance rule; `greedy`
requests (temperature 0) take the argmax, first index on ties, exactly like
`flare run`'s scheduler, so a served greedy answer equals `flare run --json`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k keeps the k likeliest tokens (None: all); top_p in (0, 1]
    keeps the smallest set of tokens holding that mass."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class TokenChooser:
    """One per request: its parameters, its generator, and the contract's forbidden ids."""

    def __init__(self, params: SamplingParams, never: Sequence[int]):
        self.params = params
        self.never = [int(t) for t in never]
        self.rng = np.random.default_rng(params.seed)

    def _masked(self, logits: np.ndarray) -> np.ndarray:
        v = np.asarray(logits, np.float64).reshape(-1).copy()
        v[[t for t in self.never if t < v.size]] = -np.inf
        return v

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a token is drawn from (one-hot at the argmax when greedy)."""
        v = self._masked(logits)
        if self.params.greedy:
            p = np.zeros_like(v)
            p[int(np.argmax(v))] = 1.0
            return p
        v = v / self.params.temperature
        k = self.params.top_k
        if k is not None and 0 < k < v.size:
            v[v < np.sort(v)[-k]] = -np.inf
        p = np.exp(v - v.max())
        p /= p.sum()
        if 0.0 < self.params.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < self.params.top_p
            p[order[~keep]] = 0.0
            p /= p.sum()
        return p

    def draw(self, p: np.ndarray) -> int:
        """A token from distribution `p` with this request's generator (never a zero-probability id:
        side="right" gives cdf[idx-1] <= u*total < cdf[idx], so p[idx] > 0)."""
        cdf = np.cumsum(p)
        idx = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return min(idx, p.size - 1)

    def __call__(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(self._masked(logits)))
        return self.draw(self.probs(logits))

    def uniform(self) -> float:
        return float(self.rng.random())
