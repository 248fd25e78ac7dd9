"""Per-request token choice: greedy, or seeded temperature / top-k / top-p sampling.

The one sampler of token LMs: a served core runs without its model plugin, so
the choice rule lives here, driven only by the manifest (`never`: ids the
contract forbids); `flare run NAME.core`, `flare serve` and moe-lm's own
`Sampler` all use it. Work is in float64 on the host. `greedy` requests
(temperature 0) take the argmax, first index on ties, so a served greedy
answer equals `flare run --json`'s.

Reproducibility: the uniform number behind the token at output index `i` of a
request is a pure function of (seed, i) (`uniform(i)`: a fresh Philox stream
keyed by both), never of how many numbers were drawn before. A token is drawn
by inverse CDF from that number, so the same request gives the same tokens
whether its tokens came from plain decode steps, mixed steps or speculative
rounds, whatever other traffic the server had.

Every parameter edge is guarded rather than trusted: temperatures so small that
`logits / T` would overflow (the logits are shifted by their maximum first, so
the largest becomes 0 and the rest -inf at worst: the argmax, as the limit
says), top_p 0 (the likeliest token only), NaN logits (never chosen), and logits
with no finite allowed value at all (a `SamplingError`, never a forbidden id).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from flare.core.errors import FlareError, InputError


class SamplingError(FlareError):
    """The logits leave no token to choose (every allowed logit is NaN or -inf)."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k keeps the k likeliest tokens (None: all); top_p in [0, 1] keeps
    the smallest set of tokens holding that mass (0: the likeliest only). Checked at construction."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int | None = None

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InputError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= p <= 1.0):
            raise InputError(f"top_p must be a number in [0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise InputError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise InputError(f"top_k must be an integer >= 1, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class TokenChooser:
    """One per request: its parameters, its seed, and the contract's forbidden ids.

    `__call__(logits, index)` chooses the token at output index `index` (default: one more than the
    last call's), so callers that know the index (the serve loop, speculative verification) get
    tokens that depend only on (seed, index, logits)."""

    def __init__(self, params: SamplingParams, never: Sequence[int]):
        self.params = params
        self.never = [int(t) for t in never]
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._next = 0

    def _masked(self, logits: np.ndarray) -> np.ndarray:
        v = np.asarray(logits, np.float64).reshape(-1).copy()
        v[np.isnan(v)] = -np.inf
        v[[t for t in self.never if t < v.size]] = -np.inf
        if not np.isfinite(v.max(initial=-np.inf)):
            if np.isposinf(v).any():          # +inf logits: the likeliest tokens, equally likely
                return np.where(np.isposinf(v), 0.0, -np.inf)
            raise SamplingError(f"no token to choose: every allowed logit of {v.size} is NaN or -inf")
        return v

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a token is drawn from (one-hot at the argmax when greedy)."""
        v = self._masked(logits)
        if self.params.greedy:
            p = np.zeros_like(v)
            p[int(np.argmax(v))] = 1.0
            return p
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            v = (v - v.max()) / self.params.temperature   # max -> 0, others <= 0 (-inf when T underflows)
        v[np.isnan(v)] = -np.inf                          # -inf / tiny T, never an allowed finite logit
        k = self.params.top_k
        if k is not None and 0 < k < v.size:
            v[v < np.sort(v)[-k]] = -np.inf
        p = np.exp(v)
        p /= p.sum()                                      # >= 1: the maximum's exp(0)
        if self.params.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < self.params.top_p
            keep[0] = True                                # top_p 0: the likeliest token alone
            p[order[~keep]] = 0.0
            p /= p.sum()
        return p

    def uniform(self, index: int) -> float:
        """The uniform number of output index `index`: a function of (seed, index) only."""
        return float(np.random.Generator(np.random.Philox(key=self.seed, counter=index)).random())

    def draw(self, p: np.ndarray, index: int) -> int:
        """The token at output index `index` from distribution `p`, by inverse CDF of `uniform(index)`
        (never a zero-probability id: side="right" gives cdf[idx-1] <= u*total < cdf[idx], so p[idx] > 0)."""
        cdf = np.cumsum(p)
        idx = int(np.searchsorted(cdf, self.uniform(index) * cdf[-1], side="right"))
        idx = min(idx, p.size - 1)
        while p[idx] <= 0.0:                  # rounding at the very top of the cdf: the last possible id
            idx -= 1
        return idx

    def __call__(self, logits: np.ndarray, index: int | None = None) -> int:
        index = self._next if index is None else index
        self._next = index + 1
        if self.params.greedy:
            return int(np.argmax(self._masked(logits)))
        return self.draw(self.probs(logits), index)
