"""Keep Python's cyclic garbage collector off the plans a runner keeps (`after_trace`).

Why: a traced call leaves plans behind (compiled closures, bindings, tensors:
~200k Python objects for Piper after 20 sentences) that live as long as the
runner. Python's collector walks every tracked object on each full collection
(~0.15 s each on Piper), and new sentences made it run one or two a sentence:
~10% of a new sentence's time, for objects that are never garbage.

What it does: after a call that traced, the young generations are collected
(cheap: only what the call made) and everything still alive is moved to the
collector's permanent generation (`gc.freeze()`), which full collections skip.
Frozen objects are still freed by reference counting; only cycles among them
wait. So that those (an evicted plan's cycles) do not pile up, once the frozen
count has doubled since the last reclaim (and is past `RECLAIM_AT`), everything
is unfrozen, collected once, and frozen again: amortized, like the collector's
own rule for full collections (it waits for 25% growth; this waits for 100%).
A reclaim that finds (almost) nothing (under `BARREN` of what survives it) doubles the
growth the next one waits for, up to `MAX_GROWTH`; one that finds garbage sets it back to
2. Why: a runner whose plans make no cycles (Piper's: 0 objects collected of ~190k) paid a
full pass of ~0.13-0.15 s at every doubling for nothing.

The freeze is process-wide (Python has one permanent generation): objects the
application made before a traced call are frozen too, and its cyclic garbage
among them waits for the next reclaim (or its own `gc.unfreeze()`). A process
that manages `gc.freeze()` itself (a pre-fork server) passes
`OnnxRunner(..., freeze_gc=False)`. The collector is never disabled.
"""
from __future__ import annotations

import gc
import threading
from dataclasses import dataclass

RECLAIM_AT = 100_000  # frozen objects below which no reclaim runs (one full collection ~0.1 s past this)
BARREN = 0.01         # a reclaim collecting less than this share of its survivors found nothing worth it
MAX_GROWTH = 16       # the most the frozen count may grow (x) before a reclaim after barren ones


@dataclass
class Counts:
    """Process-wide, like the permanent generation itself: runners made and released one after
    another (ONNX's backend suite makes ~1,900) each freeze a little, and the cycles their plans
    leave must still be reclaimed once the total has doubled."""

    base: int = 0      # objects frozen after the last reclaim
    frozen: int = 0    # objects frozen since, plus base (an upper bound: some were freed since)
    reclaims: int = 0
    growth: int = 2    # the next reclaim waits for frozen > growth * base


COUNTS = Counts()
_LOCK = threading.Lock()  # runners on different threads freeze and reclaim one at a time


class FreezePolicy:
    """What one runner does after a traced call (`enabled`: its `freeze_gc`); thread-safe."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def after_trace(self) -> None:
        if not self.enabled or not gc.isenabled():
            return
        with _LOCK:
            gc.collect(1)  # what the call left as cyclic garbage, before it is frozen
            # counted here, not by gc.get_freeze_count(): that walks the whole permanent generation
            # (~30 ms at Piper's 200k objects); the oldest generation after collect(1) is what is new
            COUNTS.frozen += len(gc.get_objects(generation=2))
            if COUNTS.frozen > max(RECLAIM_AT, COUNTS.growth * COUNTS.base):
                reclaim()
            gc.freeze()


def reclaim() -> None:
    """Unfreeze, collect everything once, and remember the size that survived and how long the
    next reclaim waits (under _LOCK)."""
    gc.unfreeze()
    collected = gc.collect()
    COUNTS.reclaims += 1
    COUNTS.base = COUNTS.frozen = len(gc.get_objects(generation=2))
    COUNTS.growth = min(2 * COUNTS.growth, MAX_GROWTH) if collected < BARREN * COUNTS.base else 2
