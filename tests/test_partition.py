"""Scheduler (issue 3): splits, copies, placement, strict mode, and allocation failure
that is propagated and leaks nothing — on several logical CPU devices."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.errors import AllocationError, PlacementError
from flare.core.graph import GraphBuilder
from flare.core.ledger import LEDGER
from flare.core.reference import evaluate
from flare.core.session import Session


@pytest.fixture(autouse=True)
def _unfused(monkeypatch):
    """These tests name the nodes of each split: they partition the graph as built
    (fusion, which merges mm1 + act1, has its own tests in test_fusion.py)."""
    monkeypatch.setenv("FLARE_FUSION", "0")

RNG = np.random.default_rng(11)
W1 = RNG.uniform(-1, 1, (24, 16)).astype(np.float32)
W2 = RNG.uniform(-1, 1, (16, 24)).astype(np.float32)


def two_layer(b, shapes):
    x = b.input("x", shapes["x"])
    h = b.gelu(b.matmul(x, b.weight("w1", W1), transpose_b=True, name="mm1"), name="act1")
    h2 = b.add(h, b.scale(h, scale=0.5, name="half"), name="res")
    y = b.matmul(h2, b.weight("w2", W2), transpose_b=True, name="mm2")
    b.output("y", b.softmax(y, name="probs"))
    b.output("h", h)


def expected(x):
    b = GraphBuilder()
    two_layer(b, {"x": x.shape})
    return evaluate(b.build(), {"x": x})[0]


def by_name(mapping):
    return lambda t, devices: mapping.get(t.name)


X = RNG.uniform(-1, 1, (5, 16)).astype(np.float32)


def run(devices, placement=None, strict=False, **cfg):
    with Session(devices, config=cfg or None) as sess:
        with sess.prepare({"full": two_layer}, {"full": {"x": X.shape}}, placement=placement, strict=strict) as pg:
            out = pg.execute("full", x=X)
            return out, pg.describe()["entries"]["full"], pg.current_plan("full").schedule


def test_single_device_is_one_split():
    out, info, _ = run(["cpu:0", "cpu:1"])
    assert info["splits"] == 1 and info["copies"] == 0
    for k, v in expected(X).items():
        np.testing.assert_allclose(out[k], v, rtol=1e-5, atol=1e-6)


def test_weights_follow_and_split_boundaries():
    # w2 lives on cpu:1: mm2 follows it; probs goes to the highest-priority device again
    out, info, sched = run(["cpu:0", "cpu:1"], placement=by_name({"w2": "cpu:1"}))
    assert [(s.device, [n.name for n in s.nodes]) for s in sched.splits] == [
        ("cpu:0", ["mm1", "act1", "half", "res"]), ("cpu:1", ["mm2"]), ("cpu:0", ["probs"])]
    assert info["copies"] == 2  # res -> cpu:1, mm2 -> cpu:0
    single, _, _ = run(["cpu:0"])
    for k in single:
        np.testing.assert_array_equal(out[k], single[k])  # exactly equal: same kernels, same order


def test_placement_override_of_a_node_and_minimal_copies():
    # act1's output is read by half and res on cpu:1: copied once, not twice
    out, info, sched = run(["cpu:0", "cpu:1"], placement=by_name({"half": "cpu:1", "res": "cpu:1"}))
    moved = [s for s in sched.splits if s.device == "cpu:1"]
    assert len(moved) == 1 and [n.name for n in moved[0].nodes] == ["half", "res"]
    assert [c.src.name for c in moved[0].copies] == ["act1"]
    for split in sched.splits:
        srcs = [c.src.id for c in split.copies]
        assert len(srcs) == len(set(srcs)), "no tensor copied twice into one split"
    assert info["bytes_copied_per_execute"] == 2 * 5 * 24 * 4  # act1 there, res back
    for k, v in expected(X).items():
        np.testing.assert_allclose(out[k], v, rtol=1e-5, atol=1e-6)


def test_strict_mode_lists_nodes_that_would_fall_back(monkeypatch):
    """cpu:0 is made to refuse gelu (as a GPU backend refuses an op it lacks)."""
    from flare.backends.cpu import device as cpu_device

    original = cpu_device.CpuDevice.supports
    monkeypatch.setattr(cpu_device.CpuDevice, "supports",
                        lambda self, node: original(self, node) and not (self.name == "cpu:0" and node.op == "gelu"))
    out, info, sched = run(["cpu:0", "cpu:1"])
    assert [s.device for s in sched.splits] == ["cpu:0", "cpu:1", "cpu:0"]
    with pytest.raises(PlacementError, match="act1") as err:
        run(["cpu:0", "cpu:1"], strict=True)
    assert err.value.nodes == ["act1"]
    with pytest.raises(PlacementError, match="no device supports"):
        run(["cpu:0"])


def test_bad_placement_answer_is_an_error():
    with pytest.raises(PlacementError, match="gpu:7"):
        run(["cpu:0"], placement=by_name({"mm1": "gpu:7"}))


def _attempt(placement):
    with Session(["cpu:0", "cpu:1"]) as sess:
        ws = sess.workspace()
        pg = sess.prepare({"full": two_layer}, {"full": {"x": X.shape}}, placement=placement, workspace=ws)
        out = pg.execute("full", x=X)
        pg.release()
        return out


def test_every_allocation_failure_is_propagated_and_leaks_nothing():
    place = by_name({"w2": "cpu:1", "half": "cpu:1"})
    with LEDGER.count_allocations() as counter:
        want = _attempt(place)
    n_allocs = counter.seen
    # w1, w2, their packed copies (the CPU packs constant f32 weights for its batch-invariant
    # product at any row count), the input, one arena on each device
    assert n_allocs == 7
    for n in range(1, n_allocs + 1):
        before = LEDGER.snapshot()
        with LEDGER.fail_at(n) as inj, pytest.raises(AllocationError, match="injected"):
            _attempt(place)
        assert inj.fired == 1
        assert LEDGER.snapshot().live == before.live, f"allocation #{n} failing leaked buffers"
    got = _attempt(place)  # recovery: the same prepare now succeeds
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_real_memory_limit_raises_and_recovers():
    big = RNG.uniform(-1, 1, (4000, 16)).astype(np.float32)
    with Session(["cpu"], config={"cpu": {"memory_limit": "256KiB"}}) as sess:
        before = LEDGER.snapshot()
        with pytest.raises(AllocationError) as err:
            sess.prepare({"full": two_layer}, {"full": {"x": big.shape}})
        e = err.value
        assert e.backend == "cpu:0" and e.asked > e.free and "cpu:0" in str(e)
        assert LEDGER.snapshot().live == before.live
        pg = sess.prepare({"full": two_layer}, {"full": {"x": X.shape}})  # fits: recovers
        np.testing.assert_allclose(pg.execute("full", x=X)["y"], expected(X)["y"], rtol=1e-5, atol=1e-6)
        with pytest.raises(AllocationError):  # growing past the limit at execute time
            pg.execute("full", x=big)
        np.testing.assert_allclose(pg.execute("full", x=X)["y"], expected(X)["y"], rtol=1e-5, atol=1e-6)


def test_memory_limit_from_environment(monkeypatch):
    monkeypatch.setenv("FLARE_CPU_MEMORY_LIMIT", "1KiB")
    with Session(["cpu"]) as sess, pytest.raises(AllocationError):
        sess.prepare({"full": two_layer}, {"full": {"x": X.shape}})


def test_repeated_multi_device_executes_allocate_nothing():
    with Session(["cpu:0", "cpu:1"]) as sess:
        pg = sess.prepare({"full": two_layer}, {"full": {"x": X.shape}}, placement=by_name({"w2": "cpu:1"}))
        pg.execute("full", x=X)
        with LEDGER.count_allocations() as counter:
            for _ in range(25):
                pg.execute("full", x=X)
        assert counter.seen == 0
        pg.release()


def test_a_state_write_placed_away_from_its_state_is_refused():
    """Otherwise the write would land in a copy of the state and be lost."""
    def build(b, shapes):
        x, st = b.input("x", (1, 4)), b.state("s", (1, 4))
        y = b.add(x, st, name="use")
        b.copy_into(st, y, name="write")
        b.output("y", y)
    with Session(["cpu:0", "cpu:1"]) as sess:
        with pytest.raises(PlacementError, match="'write'.*lives on cpu:0"):
            sess.prepare({"full": build}, {"full": {"x": (1, 4)}}, placement=by_name({"write": "cpu:1", "s": "cpu:0"}))
        # placing the state itself moves its writer with it
        pg = sess.prepare({"full": build}, {"full": {"x": (1, 4)}}, placement=by_name({"s": "cpu:1"}))
        ones = np.ones((1, 4), np.float32)
        assert [pg.execute("full", x=ones)["y"][0, 0] for _ in range(3)] == [1, 2, 3]
