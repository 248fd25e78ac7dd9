"""Choosing the next token from logits: greedy, or seeded sampling.

Sampling is done on the host in float64 from the step's logits, with its own
seeded generator, so the same logits and seed always give the same tokens
(the bitwise-equality tests between expert modes rely on it). Special tokens
that are never generated (<bos>, <pad>, <sep>) are excluded; <eos> ends a request.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import BOS, PAD, SEP

NEVER = (BOS, PAD, SEP)


@dataclass(frozen=True)
class Sampling:
    """greedy=True takes the argmax (first index on ties); otherwise temperature /
    top-k / top-p sampling with `seed`."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0


class Sampler:
    """Stateful: one generator per request, advanced once per sampled token."""

    def __init__(self, sampling: Sampling | None = None):
        self.sampling = sampling or Sampling()
        self._rng = np.random.default_rng(self.sampling.seed)

    def __call__(self, logits: np.ndarray) -> int:
        s = self.sampling
        v = np.asarray(logits, np.float64).reshape(-1).copy()
        v[[t for t in NEVER if t < v.size]] = -np.inf
        if s.greedy or s.temperature <= 0:
            return int(np.argmax(v))
        v = v / s.temperature
        if s.top_k is not None and 0 < s.top_k < v.size:
            cut = np.sort(v)[-s.top_k]
            v[v < cut] = -np.inf
        p = np.exp(v - v.max())
        p /= p.sum()
        if s.top_p is not None and 0 < s.top_p < 1:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < s.top_p
            drop = order[~keep]
            p[drop] = 0.0
            p /= p.sum()
        cdf = np.cumsum(p)
        # side="right": cdf[idx-1] <= u*total < cdf[idx], so p[idx] > 0 (a dropped token is never chosen)
        idx = int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"))
        return min(idx, v.size - 1)
