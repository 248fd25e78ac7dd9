"""Are two runs' outputs the same? Bitwise first, then within a stated tolerance.

A benchmark that gets faster by computing something else is worthless, so
every run's outputs are compared: each run with the first run of its own
configuration (a configuration must be deterministic) and A's first run with
B's. `identical` means bitwise equal (NaNs in the same places count as
equal); otherwise the largest absolute difference is reported against the
workload's tolerance, with the first request where the outputs part.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class OutputCheck:
    identical: bool
    within_tolerance: bool
    max_abs_diff: float
    tolerance: float
    first_mismatch: int | None   # request index of the first output beyond tolerance (or not identical)
    detail: str = ""

    @property
    def verdict(self) -> str:
        """'identical', 'within tolerance' or 'DIFFERENT' (what tables print)."""
        if self.identical:
            return "identical"
        return "within tolerance" if self.within_tolerance else "DIFFERENT"

    def summary(self) -> str:
        if self.identical:
            return "identical (bitwise)"
        rel = "<=" if self.within_tolerance else ">"
        where = f", first at request {self.first_mismatch}" if self.first_mismatch is not None else ""
        return f"{self.verdict}: max |diff| {self.max_abs_diff:.3g} {rel} tolerance {self.tolerance:g}{where}" + (
            f" ({self.detail})" if self.detail else "")

    def to_json(self) -> dict:
        return {"identical": self.identical, "within_tolerance": self.within_tolerance,
                "max_abs_diff": self.max_abs_diff, "tolerance": self.tolerance,
                "first_mismatch": self.first_mismatch, "detail": self.detail, "verdict": self.verdict}


def compare_outputs(a: Sequence[np.ndarray], b: Sequence[np.ndarray], tolerance: float) -> OutputCheck:
    """Compare request by request; a different count or shape is DIFFERENT with the reason."""
    if len(a) != len(b):
        return OutputCheck(False, False, float("inf"), tolerance, None, f"{len(a)} outputs vs {len(b)}")
    identical, worst, first_diff, first_bad = True, 0.0, None, None
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            return OutputCheck(False, False, float("inf"), tolerance, i, f"request {i}: shape {x.shape} vs {y.shape}")
        if np.array_equal(x, y, equal_nan=x.dtype.kind in "fc" and y.dtype.kind in "fc"):
            continue
        identical = False
        first_diff = i if first_diff is None else first_diff
        diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
        diff[np.isnan(diff)] = np.inf       # NaN on one side only
        d = float(diff.max()) if diff.size else 0.0
        worst = max(worst, d)
        if d > tolerance and first_bad is None:
            first_bad = i
    within = first_bad is None
    return OutputCheck(identical, within, worst, tolerance,
                       None if identical else (first_bad if first_bad is not None else first_diff))
