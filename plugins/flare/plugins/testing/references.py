"""Float64 references that kernel tests of several backends compare against.

The conformance suite's references are each op's own NumPy code (`flare.core.ops`);
these are independent step-by-step versions in float64, written from docs/ops.md,
for tests that check a kernel's accumulation order or thread split tightly.
"""
from __future__ import annotations

import numpy as np


def lstm_f64(x: np.ndarray, w: np.ndarray, h: np.ndarray, c: np.ndarray) -> np.ndarray:
    """docs/ops.md `lstm`, step by step in float64: x [T, B, 4H] (input gates), w [4H, H],
    h, c [B, H]; returns [T, B, 2H] (h then c of every step)."""
    H = w.shape[1]
    h, c = h.astype(np.float64), c.astype(np.float64)
    out = np.zeros(x.shape[:2] + (2 * H,))

    def sig(v: np.ndarray) -> np.ndarray:
        return 1 / (1 + np.exp(-v))

    for t in range(x.shape[0]):
        z = x[t].astype(np.float64) + h @ w.astype(np.float64).T
        c = sig(z[:, H:2 * H]) * c + sig(z[:, :H]) * np.tanh(z[:, 2 * H:3 * H])
        h = sig(z[:, 3 * H:]) * np.tanh(c)
        out[t] = np.concatenate([h, c], axis=1)
    return out
