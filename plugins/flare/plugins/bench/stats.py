"""Small statistics for benchmark figures (no SciPy): median, percentiles, ratio summaries."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def median(values: Sequence[float]) -> float:
    return float(np.median(values)) if len(values) else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), nan for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def ratio(b: float, a: float) -> float:
    """b / a, nan where a is 0 or either is nan (a peer without device memory has a ledger peak of 0)."""
    if not a or math.isnan(a) or math.isnan(b):
        return float("nan")
    return b / a


def geomean(values: Sequence[float]) -> float:
    vals = [v for v in values if v > 0 and not math.isnan(v)]
    return float(math.exp(sum(math.log(v) for v in vals) / len(vals))) if vals else float("nan")
