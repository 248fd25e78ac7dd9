"""The order of runs: blocks of A, B, B, A.

Why: the machine drifts (page cache warms, a neighbour starts a build, the
CPU clocks down). In A B B A each configuration sits once on each side of the
block's middle, so a linear drift adds the same to A's and B's totals, and
the B/A ratio of each adjacent pair (A1 B1) and (B2 A2) is measured between
runs seconds apart.
"""
from __future__ import annotations

from dataclasses import dataclass

PATTERN = ("A", "B", "B", "A")


@dataclass(frozen=True)
class Slot:
    """One run: configuration key, block number, position in the block, position overall."""

    key: str
    block: int
    position: int
    index: int


def abba(blocks: int) -> list[Slot]:
    """Run slots for `blocks` blocks of A B B A."""
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    return [Slot(key, b, p, b * len(PATTERN) + p) for b in range(blocks) for p, key in enumerate(PATTERN)]


def pairs(blocks: int) -> list[tuple[int, int]]:
    """(A run index, B run index) of each adjacent pair: (A1, B1) and (A2, B2) per block."""
    out = []
    for b in range(blocks):
        base = b * len(PATTERN)
        out += [(base, base + 1), (base + 3, base + 2)]
    return out
