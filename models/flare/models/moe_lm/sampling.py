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
    """Stateful: one generator per request, advanced once per sampled token. The rule is the
    token-LM sampler an exported core is served with (`flare.plugins.export.serving.sampling`),
    so `flare run moe-lm` and a served moe-lm core choose tokens the same way."""

    def __init__(self, sampling: Sampling | None = None):
        from flare.plugins.export.serving.sampling import SamplingParams, TokenChooser

        self.sampling = s = sampling or Sampling()
        greedy = s.greedy or s.temperature <= 0
        params = SamplingParams(temperature=0.0 if greedy else s.temperature,
                                top_p=s.top_p if s.top_p is not None else 1.0, seed=s.seed, top_k=s.top_k)
        self._choose = TokenChooser(params, NEVER)

    def __call__(self, logits: np.ndarray) -> int:
        return self._choose(logits)
