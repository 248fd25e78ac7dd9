"""The lifecycle on the backend under test: state, re-planning, reset, release, leaks.

The graphs here need matmul, tanh, add, sum and copy_into. A partial backend
need not have them all: every test opens the backend's device with a CPU device
behind it (`backend.fallback_session()`), so the nodes it refuses run on the CPU
with copies in between — as a user runs such a backend — and the coverage
summary lists those ops. What the device supports must run on it."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.errors import InputError, ReleasedError
from flare.core.ledger import LEDGER
from flare.core.session import Session
from flare.plugins.testing.pytest_plugin import FALLBACK, record_fallback

RNG = np.random.default_rng(7)
W1 = RNG.uniform(-1, 1, (16, 8)).astype(np.float32)
W2 = RNG.uniform(-1, 1, (8, 16)).astype(np.float32)


def mlp(b, shapes):
    """x -> tanh(x W1^T) W2^T + acc (acc is state accumulating the output sum over calls)."""
    x = b.input("x", shapes["x"])
    h = b.tanh(b.matmul(x, b.weight("w1", W1), transpose_b=True))
    y = b.matmul(h, b.weight("w2", W2), transpose_b=True)
    acc = b.state("acc", (1, 8))
    total = b.add(b.sum(y, axis=0, keepdims=True), acc)
    b.copy_into(acc, total)
    b.output("y", y)
    b.output("acc", total)


def body(b, shapes):
    """A second entry point sharing weights and state with `full`."""
    x = b.input("x", shapes["x"])
    h = b.tanh(b.matmul(x, b.weight("w1", W1), transpose_b=True))
    b.output("h", b.add(h, b.sum(b.state("acc", (1, 8)), axis=1, keepdims=True)))


def reference(x, acc):
    h = np.tanh(x.astype(np.float64) @ W1.T.astype(np.float64))
    y = h @ W2.T.astype(np.float64)
    return y, acc + y.sum(0, keepdims=True)


def _device_counts(session: Session) -> dict:
    return {d.name: (LEDGER.snapshot().count(d.name), dict(d.live_objects())) for d in session.devices}


def _check_placement(request, backend, sess: Session, pg) -> None:
    """Nodes the backend's device supports run on it (it is first), except where the scheduler's
    earlier rules send them (a state write goes to its state, a weight's reader may follow the
    weight); record the ops the CPU took for the coverage summary."""
    from flare.core.graph import WEIGHT
    from flare.core.ops import OPS

    device = sess.devices[0]
    fell = []
    for entry in pg.entries:
        plan = pg.current_plan(entry)
        on = plan.schedule.device_of
        for node in plan.graph.nodes:
            if OPS[node.op].view is not None or node.op == "host" or on.get(node.id, device.name) == device.name:
                continue
            follows = OPS[node.op].writes_src0 or any(s.storage.role == WEIGHT for s in node.srcs)
            assert follows or not device.supports(node), \
                f"{node.name} ({node.op}) is supported by {device.name} but ran on {on[node.id]}"
            fell.append(node.op)
    record_fallback(request, backend.name, fell)


def test_state_reset_replan_release(backend, request):
    with backend.fallback_session() as sess:
        start = _device_counts(sess)
        ws = sess.workspace()
        pg = sess.prepare({"full": mlp, "body": body}, {"full": {"x": (4, 8)}, "body": {"x": (4, 8)}}, workspace=ws)
        _check_placement(request, backend, sess, pg)
        acc = np.zeros((1, 8))
        for n in (4, 4, 9, 2):  # same, same, longer (re-plan + grow), shorter (reuse)
            x = RNG.uniform(-1, 1, (n, 8)).astype(np.float32)
            out = pg.execute("full", x=x)
            y, acc = reference(x, acc)
            np.testing.assert_allclose(out["y"], y, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(out["acc"], acc, rtol=1e-4, atol=1e-4)
        grown = ws.nbytes()
        x = RNG.uniform(-1, 1, (3, 8)).astype(np.float32)
        h = pg.execute("body", x=x)["h"]
        np.testing.assert_allclose(h, np.tanh(x.astype(np.float64) @ W1.T) + acc.sum(), rtol=1e-4, atol=1e-4)
        assert ws.nbytes() == grown, "a smaller request must reuse the workspace"
        pg.reset()
        out = pg.execute("full", x=x)
        np.testing.assert_allclose(out["acc"], reference(x, np.zeros((1, 8)))[1], rtol=1e-4, atol=1e-4)
        pg.release()
        pg.release()  # idempotent
        with pytest.raises(ReleasedError):
            pg.execute("full", x=x)
        assert _device_counts(sess) == start, "release must return every buffer and backend object"


def test_bad_inputs_are_typed_errors(backend):
    with backend.fallback_session() as sess, sess.prepare({"full": mlp}, {"full": {"x": (2, 8)}}) as pg:
        with pytest.raises(InputError, match="dtype"):
            pg.execute("full", x=np.zeros((2, 8), np.float64))
        with pytest.raises(InputError, match="missing"):
            pg.execute("full")
        with pytest.raises(InputError, match="rank"):
            pg.execute("full", x=np.zeros((2, 8, 1), np.float32))
        with pytest.raises(InputError, match="unknown entry"):
            pg.execute("nope", x=np.zeros((2, 8), np.float32))


def test_repeated_executes_allocate_nothing(backend):
    with backend.fallback_session() as sess, sess.prepare({"full": mlp}, {"full": {"x": (5, 8)}}) as pg:
        x = RNG.uniform(-1, 1, (5, 8)).astype(np.float32)
        pg.execute("full", x=x)
        with LEDGER.count_allocations() as counter:
            for _ in range(20):
                pg.execute("full", x=x)
        assert counter.seen == 0


def test_with_cpu_equals_alone(backend):
    """The backend next to a CPU device (placement splits the graph) matches it alone (alone:
    with the CPU fallback behind it for what it refuses)."""
    other = "cpu:1" if backend.name == FALLBACK else FALLBACK
    first = backend.name if backend.name != FALLBACK else "cpu:0"
    x = RNG.uniform(-1, 1, (6, 8)).astype(np.float32)
    with backend.fallback_session() as alone, alone.prepare({"full": mlp}, {"full": {"x": x.shape}}) as pg:
        want = pg.execute("full", x=x)

    def place(t, devices):
        return other if t.name.startswith("tanh") or t.name == "w2" else None

    with Session([first, other]) as mixed, mixed.prepare({"full": mlp}, {"full": {"x": x.shape}}, placement=place) as pg:
        got = pg.execute("full", x=x)
        summary = pg.describe()["entries"]["full"]
        assert summary["splits"] >= 2 and summary["copies"] >= 1
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
