"""Vulkan device memory and lifecycle: limits, allocation failures, staging, leaks, release order."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.backend import Binding, SplitProgram
from flare.core.errors import AllocationError, FlareError, ReleasedError
from flare.core.graph import GraphBuilder, Tensor, contiguous_strides
from flare.core.ledger import LEDGER

from flare.backends.vulkan import VulkanBackend
from flare.backends.vulkan.device import ENV_FORCE_STAGING
from flare.backends.vulkan.testing import HandBound

PROBE = VulkanBackend.probe()
pytestmark = pytest.mark.skipif(not PROBE.usable, reason=f"Vulkan unusable here: {PROBE.reason}")
RNG = np.random.default_rng(5)


@pytest.fixture(params=["mapped", "staged"])
def dev(request):
    (device,) = VulkanBackend.open_devices({"force_staging": request.param == "staged", "max_buffer_size": 1 << 20})
    yield device
    device.close()


def _counts(dev):
    return LEDGER.snapshot().count(dev.name), LEDGER.live_bytes(dev.name), dev.live_objects()


def _mlp_graph():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    h = b.tanh(b.matmul(x, b.weight("w", RNG.uniform(-1, 1, (8, 8)).astype(np.float32)), transpose_b=True))
    b.output("y", b.softmax(b.add(h, x)))
    return b.build()


def test_buffer_type_and_memory(dev):
    bt = dev.buffer_type()
    assert bt.alignment >= 16 and bt.alignment % dev.info.min_storage_offset_alignment == 0
    assert bt.max_size == min(1 << 20, dev.info.max_storage_buffer_range, dev.info.max_memory_allocation_size)
    before = dev.memory()
    buf = dev.alloc(4096, tag="t")
    assert dev.memory().free == before.free - 4096 and dev.memory().total == before.total
    buf.release()
    assert dev.memory().free == before.free


@pytest.mark.parametrize("nbytes", [(1 << 20) + 1, 1 << 40])
def test_allocation_above_limits_raises_and_leaves_nothing(dev, nbytes):
    start = _counts(dev)
    with pytest.raises(AllocationError) as err:
        dev.alloc(nbytes, tag="too-big")
    assert err.value.backend == dev.name and err.value.asked == nbytes and err.value.free > 0
    with pytest.raises(AllocationError):
        dev._alloc_raw(nbytes)  # the raw hook refuses too, it never hands out a null buffer
    assert _counts(dev) == start


def test_driver_out_of_memory_becomes_allocation_error(dev):
    """Past Flare's checks, a size the driver refuses surfaces as AllocationError, cleaned up."""
    start = _counts(dev)
    with pytest.raises(AllocationError, match="vkCreateBuffer|vkAllocateMemory"):
        dev.memory_pool.create(1 << 44)
    assert _counts(dev) == start


def test_staging_mode_has_no_host_view_and_roundtrips(dev):
    buf = dev.alloc(1024)
    try:
        b = Binding(buf, 64, (3, 5), (5, 1), "f32")
        x = RNG.standard_normal((3, 5)).astype(np.float32)
        dev.write(b, x)
        np.testing.assert_array_equal(dev.read(b), x)
        view = dev.host_view(b)
        assert (view is None) == dev.force_staging
        # strided target (a transposed view): read-modify-write keeps the untouched bytes
        bt = Binding(buf, 64, (5, 3), (1, 5), "f32")
        dev.write(bt, x.T * 2)
        np.testing.assert_array_equal(dev.read(b), x * 2)
        dev.fill_zero(b)
        assert not dev.read(b).any()
    finally:
        buf.release()


def test_force_staging_from_environment(monkeypatch):
    monkeypatch.setenv(ENV_FORCE_STAGING, "1")
    (d,) = VulkanBackend.open_devices()
    try:
        assert d.force_staging and not d.mapped and d.describe()["force_staging"]
    finally:
        d.close()


def test_leak_free_after_release(dev):
    """After splits and buffers are released, live objects and ledger are back at the start."""
    start = _counts(dev)
    graph = _mlp_graph()
    for _ in range(3):
        hb = HandBound(dev, graph, gap=2)
        out = hb.run({"x": RNG.standard_normal((4, 8)).astype(np.float32)})["y"]
        np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-5)
        hb.compile()  # re-recording: the old split is released first
        hb.split.run()
        assert dev.live_objects()["descriptor_pools"] == start[2]["descriptor_pools"] + 1
        hb.release()
        hb.split = None
    assert _counts(dev) == start
    assert dev.cache_objects()["pipelines"] > 0  # the cache stays until close


def test_release_is_idempotent_and_run_after_release_is_an_error(dev):
    with HandBound(dev, _mlp_graph()) as hb:
        hb.run({"x": np.ones((4, 8), np.float32)})
        split = hb.split
        split.release()
        split.release()
        with pytest.raises(ReleasedError):
            split.run()
        hb.split = None


def test_capture_replays_with_new_inputs(dev):
    graph = _mlp_graph()
    with HandBound(dev, graph) as hb:
        hb.compile()
        outs = []
        for seed in range(3):
            x = np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)
            outs.append(hb.run({"x": x})["y"].copy())
        assert not np.allclose(outs[0], outs[1])
        x0 = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
        np.testing.assert_array_equal(hb.run({"x": x0})["y"], outs[0])


def test_failed_compile_leaves_nothing(dev):
    graph = _mlp_graph()
    with HandBound(dev, graph) as hb:
        hb.write_leaves({"x": np.ones((4, 8), np.float32)})
        start = _counts(dev)
        with LEDGER.fail_at(1) as inj:  # the split's metadata buffer allocation fails
            with pytest.raises(AllocationError):
                dev.compile(SplitProgram(dev, graph.nodes, hb.bindings))
        assert inj.fired == 1
        assert _counts(dev) == start
        bad = dict(hb.bindings)
        x = graph.inputs["x"]
        bad[x.id] = Binding(hb.buffer, 2, x.shape, contiguous_strides(x.shape), "f32")  # not f32-aligned
        with pytest.raises(FlareError, match="item size"):
            dev.compile(SplitProgram(dev, graph.nodes, bad))
        assert _counts(dev) == start


def test_supports_says_no_instead_of_failing(dev):
    # nodes made by hand: the registry would refuse some of them before a backend is asked
    x, p = Tensor(1, "x", (2, 2, 5), "f32", "input"), Tensor(2, "p", (2,), "i32", "input")
    assert not dev.supports(Tensor(3, "r", (2, 2, 5), "f32", op="rope", srcs=(x, p)))  # odd D
    a, w = Tensor(4, "a", (2, 3), "i64", "input"), Tensor(5, "w", (3, 2), "f32", "input")
    assert not dev.supports(Tensor(6, "m", (2, 2), "f32", op="matmul", srcs=(a, w)))
    assert not dev.supports(Tensor(7, "q", (2, 3), "f32", op="no_such_op", srcs=(a,)))
    b = GraphBuilder()
    assert not dev.supports(b.op("host", callback="f", shape=(2,), dtype="f32"))
    assert dev.supports(b.get_rows(b.input("t", (4, 2), "f16"), b.input("i", (3,), "i64")))


def test_close_destroys_everything():
    (d,) = VulkanBackend.open_devices()
    hb = HandBound(d, _mlp_graph())
    hb.run({"x": np.ones((4, 8), np.float32)})
    hb.release()
    assert d.cache_objects()["pipelines"] > 0
    d.close()
    d.close()  # idempotent
    assert not any(d.live_objects().values()) and not any(d.cache_objects().values())
    with pytest.raises(ReleasedError):
        d.alloc(16)


def test_close_with_live_split_and_buffer_cleans_up():
    (d,) = VulkanBackend.open_devices()
    hb = HandBound(d, _mlp_graph())
    hb.run({"x": np.ones((4, 8), np.float32)})
    with pytest.warns(ResourceWarning):
        d.close()
    assert not any(d.live_objects().values())
    hb.release()  # late release after close is harmless and clears the ledger
    assert LEDGER.snapshot().count(d.name) == 0


def test_rebind_points_the_capture_at_new_memory(dev):
    graph = _mlp_graph()
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    first, second = HandBound(dev, graph), HandBound(dev, graph, gap=3)
    try:
        want = first.run({"x": x})["y"]
        split = first.split
        assert [d.shader for d in split.dispatches][1:] == ["eltwise_chain", "rownorm"]  # rebind re-points a chain too
        objects = dev.live_objects()
        second.write_leaves({"x": x})
        assert split.rebind(SplitProgram(dev, graph.nodes, second.bindings))
        assert dev.live_objects() == objects  # same pools, command buffer and fence
        dev.fill_zero(second.bindings[graph.outputs["y"].id])
        split.run()
        np.testing.assert_array_equal(second.outputs()["y"], want)
        assert not split.rebind(SplitProgram(dev, graph.nodes[:-1], second.bindings))  # other nodes: re-compile
        split.release()
        assert not split.rebind(SplitProgram(dev, graph.nodes, second.bindings))
    finally:
        first.split = None
        first.release()
        second.release()
