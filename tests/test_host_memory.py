"""Host memory in a long-lived session, and what finalizers release.

A session keeps only weak references to its graphs and forgets a graph on
release, so prepare/release cycles do not grow the process; a graph or session
dropped without release()/close() is released by a weakref finalizer with a
ResourceWarning naming it. These are resource assertions (bytes), not timings.
"""
from __future__ import annotations

import gc
import os
import warnings

import numpy as np
import pytest

from flare.core.ledger import LEDGER
from flare.core.session import Session

CYCLES = 1000
RSS_BUDGET = 5 << 20
WEIGHT_SHAPE = (128, 128)  # 64 KiB: a graph kept alive per cycle would add 64+ MiB over the run


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _builder(seed: int):
    w = np.random.default_rng(seed).standard_normal(WEIGHT_SHAPE).astype(np.float32)  # the builder owns its weights

    def full(b, shapes):
        x = b.input("x", shapes["x"])
        b.output("y", b.relu(b.matmul(x, b.weight("w", w))))
    return full


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
def test_prepare_release_cycles_do_not_grow_the_process():
    x = np.ones((2, 128), np.float32)
    before = LEDGER.snapshot()
    with Session(["cpu"]) as sess:
        def cycle(i: int) -> None:
            # odd cycles share a workspace the session hands out (and tracks), even ones
            # get the graph's private workspace: neither may outlive its cycle
            ws = sess.workspace(f"ws{i}") if i % 2 else None
            pg = sess.prepare({"full": _builder(i)}, {"full": {"x": x.shape}}, name=f"cycle{i}", workspace=ws)
            pg.execute("full", x=x)
            pg.release()
            if ws is not None:
                assert len(sess._workspaces) == 1   # tracked while the caller holds it
                ws.release()

        for i in range(50):  # warm-up: allocator pools, import-time caches
            cycle(i)
        gc.collect()
        rss0 = _rss_bytes()
        for i in range(CYCLES):
            cycle(i)
        gc.collect()
        grown = _rss_bytes() - rss0
        assert sess.live_graphs() == []
        assert len(sess._workspaces) == 0, "the session keeps workspaces nobody holds"
    assert LEDGER.snapshot().live == before.live, "ledger not back to empty"
    assert grown < RSS_BUDGET, f"RSS grew by {grown / 2**20:.1f} MiB over {CYCLES} prepare/release cycles"


def test_dropped_graph_is_released_with_a_warning():
    before = LEDGER.snapshot()
    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": _builder(0)}, {"full": {"x": (2, 128)}}, name="forgotten")
        pg.execute("full", x=np.ones((2, 128), np.float32))
        assert LEDGER.snapshot().count() > before.count()
        with pytest.warns(ResourceWarning, match="'forgotten' was dropped without release"):
            del pg
            gc.collect()
        assert LEDGER.snapshot().live == before.live
        assert sess.live_graphs() == []


def test_dropped_session_closes_its_devices_with_a_warning():
    before = LEDGER.snapshot()
    sess = Session(["cpu"])
    device = sess.devices[0]
    pg = sess.prepare({"full": _builder(0)}, {"full": {"x": (2, 128)}}, name="orphan")
    pg.execute("full", x=np.ones((2, 128), np.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        del pg, sess
        gc.collect()
    messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert any("'orphan' was dropped without release" in m for m in messages), messages
    assert any("Session(['cpu:0']) was dropped without close()" in m for m in messages), messages
    assert device.closed
    assert LEDGER.snapshot().live == before.live


def test_released_graph_is_not_kept_by_its_session():
    import weakref

    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": _builder(0)}, {"full": {"x": (2, 128)}})
        ref = weakref.ref(pg)
        pg.release()
        del pg
        gc.collect()
        assert ref() is None
