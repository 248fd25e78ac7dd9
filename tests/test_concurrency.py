"""The concurrency contract (docs/design.md, "Concurrency"): a PreparedGraph shared
by threads gives every caller what a sequential run gives; graphs on one workspace
take turns; release, Session.close and a device's close racing executes make
those executes fail with ReleasedError — never a crash, never another error.

Graphs are tiny on purpose: the races are in the lifecycle, not the arithmetic.
"""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

from flare.core.errors import ReleasedError
from flare.core.ledger import LEDGER
from flare.plugins.testing.threads import run_threads

RNG = np.random.default_rng(14)
W = RNG.standard_normal((16, 8)).astype(np.float32)
XS = [RNG.standard_normal((4, 8)).astype(np.float32) for _ in range(8)]
THREADS, EXECUTES, ROUNDS = 4, 200, 50


def mlp(b, shapes):
    x = b.input("x", shapes["x"])
    h = b.gelu(b.matmul(x, b.weight("w", W), transpose_b=True))
    b.output("y", b.softmax(h))


def other(b, shapes):
    x = b.input("x", shapes["x"])
    b.output("y", b.tanh(b.matmul(x, b.weight("w", W), transpose_b=True)))


def test_threads_sharing_one_graph_get_sequential_outputs(backend):
    with backend.session() as sess:
        pg = sess.prepare({"full": mlp}, {"full": {"x": (4, 8)}})
        expected = [pg.execute("full", x=x)["y"] for x in XS]
        wrong = []

        def work(t: int) -> None:
            for i in range(EXECUTES):
                k = (i * 3 + t) % len(XS)
                if not np.array_equal(pg.execute("full", x=XS[k])["y"], expected[k]):
                    wrong.append((t, i))

        assert run_threads(work, THREADS) == []
        assert wrong == [], f"{len(wrong)} of {THREADS * EXECUTES} executes differ from the sequential output"
        assert pg.stats["executes"] == len(XS) + THREADS * EXECUTES


def test_graphs_on_one_workspace_take_turns(backend):
    with backend.session() as sess:
        ws = sess.workspace()
        a = sess.prepare({"full": mlp}, {"full": {"x": (4, 8)}}, workspace=ws, name="a")
        b = sess.prepare({"full": other}, {"full": {"x": (4, 8)}}, workspace=ws, name="b")
        want = {"a": [a.execute("full", x=x)["y"] for x in XS], "b": [b.execute("full", x=x)["y"] for x in XS]}
        wrong = []

        def work(t: int) -> None:
            name, pg = ("a", a) if t % 2 else ("b", b)
            for i in range(EXECUTES // 2):
                k = (i + t) % len(XS)
                if not np.array_equal(pg.execute("full", x=XS[k])["y"], want[name][k]):
                    wrong.append((name, i))

        assert run_threads(work, THREADS) == []
        assert wrong == []


def _race(pg, stop) -> None:
    """Execute until stopped by ReleasedError; any other exception escapes to the test."""
    started = threading.Event()
    outcome: list[BaseException] = []

    def work() -> None:
        try:
            while True:
                pg.execute("full", x=XS[0])
                started.set()
        except BaseException as exc:
            outcome.append(exc)
            started.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait(timeout=60)
    stop()
    t.join(timeout=60)
    assert not t.is_alive(), "an execute hung after release/close"
    assert len(outcome) == 1 and isinstance(outcome[0], ReleasedError), f"expected ReleasedError, got {outcome!r}"


def test_release_racing_executes(backend):
    before = LEDGER.snapshot()
    with backend.session() as sess:
        for _ in range(ROUNDS):
            pg = sess.prepare({"full": mlp}, {"full": {"x": (4, 8)}})
            _race(pg, pg.release)
            with pytest.raises(ReleasedError):
                pg.execute("full", x=XS[0])
        assert sess.live_graphs() == []
    assert LEDGER.snapshot().live == before.live


def test_session_close_racing_executes(backend):
    before = LEDGER.snapshot()
    for _ in range(ROUNDS):
        sess = backend.session()
        pg = sess.prepare({"full": mlp}, {"full": {"x": (4, 8)}})
        _race(pg, sess.close)
    assert LEDGER.snapshot().live == before.live


def test_device_closed_under_a_live_graph(backend):
    """Closing the device itself (not the session) while a graph runs on it: the execute in
    flight finishes, later ones raise ReleasedError, and release/close afterwards are clean."""
    before = LEDGER.snapshot()
    for _ in range(ROUNDS // 5):
        sess = backend.session()
        pg = sess.prepare({"full": mlp}, {"full": {"x": (4, 8)}})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # Vulkan frees the buffers the graph still holds
            _race(pg, sess.devices[0].close)
        with pytest.raises(ReleasedError, match="closed"):
            pg.execute("full", x=XS[0])
        pg.release()
        sess.close()
    assert LEDGER.snapshot().live == before.live
