"""CudaDevice: memory through the ledger, staging copies, CUDA-graph splits, rebind, teardown.

Tests taking `device` run on the GPU (skipped with the probe's reason where
there is none) and on the emulated device (the same CudaDevice code over the
host stand-in driver). Tests taking `emu` need the stand-in itself: they read
its call log or inject driver failures.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from flare.core.backend import Binding, SplitProgram
from flare.core.dtypes import to_numpy
from flare.core.errors import AllocationError, ReleasedError
from flare.core.graph import GraphBuilder
from flare.core.ledger import LEDGER

from flare.backends.cuda import device as device_module
from flare.backends.cuda.driver import CudaError
from flare.backends.cuda_emu.devices import KINDS, bind_graph, device_for_test, open_device


@pytest.fixture(params=KINDS)
def device(request):
    dev = device_for_test(request, request.param)
    before = LEDGER.snapshot().count(dev.name)
    yield dev
    assert LEDGER.snapshot().count(dev.name) == before, "a test leaked a buffer"
    dev.close()
    assert not any({**dev.live_objects(), **dev.cache_objects()}.values()), dev.live_objects()


@pytest.fixture
def emu():
    dev, why = open_device("emulated")
    if dev is None:
        pytest.skip(why)
    yield dev
    dev.close()


class Bound:
    """A graph with every storage tensor in its own buffer on `dev`."""

    def __init__(self, dev, graph):
        self.dev, self.graph = dev, graph
        self.buffers, self.bindings = bind_graph(dev, graph)

    def program(self) -> SplitProgram:
        return SplitProgram(self.dev, self.graph.nodes, self.bindings)

    def write(self, **inputs):
        for name, arr in inputs.items():
            self.dev.write(self.bindings[self.graph.inputs[name].id], arr)

    def read(self, name):
        return self.dev.read(self.bindings[self.graph.outputs[name].id])

    def release(self):
        for buf in self.buffers.values():
            buf.release()


def mlp_graph(n=4, d=8):
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    x = b.input("x", (n, d))
    h = b.gelu(b.add(b.matmul(x, b.weight("w1", rng.standard_normal((d, d)).astype(np.float32))),
                     b.weight("b1", rng.standard_normal(d).astype(np.float32))))
    b.output("y", b.softmax(b.layer_norm(h)))
    return b.build()


def reference(graph, x):
    from flare.core.reference import evaluate

    return evaluate(graph, {"x": x})[0]["y"]


def test_split_runs_as_a_replayed_cuda_graph(device):
    g = mlp_graph()
    bound = Bound(device, g)
    try:
        split = device.compile(bound.program())
        live = device.live_objects()
        assert live["graphs"] == 1 and live["graph_execs"] == 1 and live["streams"] == 1
        for seed in (1, 2):  # replays see new inputs
            x = np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)
            bound.write(x=x)
            split.run()
            np.testing.assert_allclose(bound.read("y"), reference(g, x), rtol=1e-5, atol=1e-6)
        assert set(device.module_formats.values()) == {"cubin"}
        split.release()
        assert device.live_objects()["graphs"] == 0 and device.live_objects()["graph_execs"] == 0
    finally:
        bound.release()


def test_replay_launches_nothing_but_the_graph(emu):
    bound = Bound(emu, mlp_graph())
    try:
        split = emu.compile(bound.program())
        log = emu.driver.log
        captured = log.count("cuLaunchKernel")
        assert captured == len(split.plan) > 1
        mark = len(log)
        split.run()
        split.run()
        assert log[mark:].count("cuLaunchKernel") == 0
        assert log[mark:].count("cuGraphLaunch") == 2
        split.release()
    finally:
        bound.release()


def test_rebind_updates_the_exec_graph_in_place(device):
    g = mlp_graph()
    first, second = Bound(device, g), Bound(device, g)
    try:
        split = device.compile(first.program())
        sentinel = np.full((4, 8), 7.0, np.float32)  # fresh device memory is not zeroed: mark the old output
        device.write(first.bindings[g.outputs["y"].id], sentinel)
        x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
        second.write(x=x)
        assert split.rebind(second.program()) is True
        assert (split.updates, split.instantiations, split.captures) == (1, 1, 2)
        assert device.live_objects()["graphs"] == 1 and device.live_objects()["graph_execs"] == 1
        split.run()
        np.testing.assert_allclose(second.read("y"), reference(g, x), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(first.read("y"), sentinel)  # the old buffers were not touched
        split.release()
    finally:
        first.release()
        second.release()


def test_rebind_falls_back_to_a_new_exec_graph(emu):
    g = mlp_graph()
    first, second = Bound(emu, g), Bound(emu, g)
    try:
        split = emu.compile(first.program())
        emu.driver.faults["cuGraphExecUpdate"] = "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE"
        x = np.ones((4, 8), np.float32)
        second.write(x=x)
        assert split.rebind(second.program()) is False
        assert (split.updates, split.instantiations) == (0, 2)
        assert emu.live_objects()["graph_execs"] == 1 and emu.driver.live()["execs"] == 1
        split.run()
        np.testing.assert_allclose(second.read("y"), reference(g, x), rtol=1e-5, atol=1e-6)
        split.release()
    finally:
        first.release()
        second.release()


def test_rebind_to_other_nodes_is_refused(device):
    g, other = mlp_graph(), mlp_graph(d=4)
    a, b = Bound(device, g), Bound(device, other)
    try:
        split = device.compile(a.program())
        with pytest.raises(ValueError, match="different nodes"):
            split.rebind(b.program())
        split.release()
    finally:
        a.release()
        b.release()


def test_release_destroys_exec_then_graph_once(emu):
    bound = Bound(emu, mlp_graph())
    try:
        split = emu.compile(bound.program())
        mark = len(emu.driver.log)
        split.release()
        tail = [c for c in emu.driver.log[mark:] if c.startswith("cuGraph")]
        assert tail == ["cuGraphExecDestroy", "cuGraphDestroy"]
        split.release()  # idempotent: no second destroy
        assert [c for c in emu.driver.log[mark:] if c.startswith("cuGraph")] == tail
        with pytest.raises(ReleasedError):
            split.run()
    finally:
        bound.release()


def test_close_tears_down_in_order_and_releases_live_splits(emu):
    bound = Bound(emu, mlp_graph())
    emu.write(bound.bindings[bound.graph.inputs["x"].id], np.ones((4, 8), np.float32))  # staging exists
    split = emu.compile(bound.program())  # left live on purpose: close() must release it
    bound.release()
    mark = len(emu.driver.log)
    emu.close()
    log = emu.driver.log[mark:]
    order = ["cuGraphExecDestroy", "cuGraphDestroy", "cuModuleUnload", "cuStreamDestroy", "cuMemFreeHost",
             "cuDevicePrimaryCtxRelease"]
    positions = [log.index(name) for name in order]
    assert positions == sorted(positions), log
    assert not any({**emu.live_objects(), **emu.cache_objects()}.values())
    assert all(n == 0 for n in emu.driver.live().values()), emu.driver.live()
    assert split.released
    emu.close()  # idempotent
    with pytest.raises(ReleasedError):
        emu.alloc(16)


def test_buffer_outliving_close_still_frees(emu):
    buf = emu.alloc(1024, "late")
    emu.close()
    assert emu.driver.context_refs == 1  # kept for the live allocation
    buf.release()
    assert emu.driver.context_refs == 0 and not emu.driver.memory


def test_device_out_of_memory_is_an_allocation_error(emu):
    emu.driver.faults["cuMemAlloc"] = "CUDA_ERROR_OUT_OF_MEMORY"
    before = LEDGER.snapshot().count(emu.name)
    with pytest.raises(AllocationError) as info:
        emu.alloc(4096, "big")
    assert info.value.backend == emu.name and info.value.asked == 4096
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(info.value)
    assert LEDGER.snapshot().count(emu.name) == before and emu.live_objects()["allocations"] == 0


def test_more_than_the_device_has_is_an_allocation_error(device):
    total = device.memory().total
    with pytest.raises(AllocationError) as info:
        device.alloc(total + (1 << 20))
    assert info.value.backend == device.name


def test_other_driver_failures_are_named(emu):
    emu.driver.faults["cuMemAlloc"] = "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(CudaError, match="cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE"):
        emu.alloc(64)


def test_capture_failure_leaves_nothing_behind(emu):
    bound = Bound(emu, mlp_graph())
    try:
        emu.driver.faults["cuLaunchKernel"] = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
        with pytest.raises(CudaError, match="LAUNCH_OUT_OF_RESOURCES"):
            emu.compile(bound.program())
        assert emu.live_objects()["graphs"] == 0 and emu.driver.live()["graphs"] == 0
        split = emu.compile(bound.program())  # the stream is not stuck in capture
        split.run()
        split.release()
    finally:
        bound.release()


def test_cubin_refused_falls_back_to_ptx(emu):
    emu.driver.faults["cuModuleLoadData"] = "CUDA_ERROR_NO_BINARY_FOR_GPU"
    emu.function("elementwise", "flare_unary")
    assert emu.module_formats["elementwise"] == "ptx"


def test_copies_round_trip(device):
    rng = np.random.default_rng(5)
    for dtype in ("f32", "f16", "i32", "i64"):
        arr = (rng.standard_normal((3, 5)) * 100).astype(to_numpy(dtype))
        buf = device.alloc(arr.nbytes + 64)
        try:
            b = Binding(buf, 64, arr.shape, (5, 1), dtype)
            device.write(b, arr)
            np.testing.assert_array_equal(device.read(b), arr)
            device.fill_zero(b)
            assert not device.read(b).any()
        finally:
            buf.release()


def test_strided_write_and_read(device):
    buf = device.alloc(4 * 12)
    try:
        whole = Binding(buf, 0, (3, 4), (4, 1), "f32")
        device.write(whole, np.arange(12, dtype=np.float32).reshape(3, 4))
        col = Binding(buf, 4, (3,), (4,), "f32")  # column 1
        np.testing.assert_array_equal(device.read(col), [1, 5, 9])
        device.write(col, np.array([-1, -2, -3], np.float32))
        expect = np.arange(12, dtype=np.float32).reshape(3, 4)
        expect[:, 1] = [-1, -2, -3]
        np.testing.assert_array_equal(device.read(whole), expect)
        out = np.empty((4, 3), np.float32)
        device.read_into(Binding(buf, 0, (4, 3), (1, 4), "f32"), out)  # transposed view
        np.testing.assert_array_equal(out, expect.T)
    finally:
        buf.release()


def test_large_copies_go_through_staging_in_chunks(device, monkeypatch):
    monkeypatch.setattr(device_module, "STAGING_CHUNK", 4096)
    monkeypatch.setattr(device_module, "STAGING_MIN", 1024)
    device._free_staging()
    arr = np.random.default_rng(7).standard_normal(10_000).astype(np.float32)  # ~10 chunks
    buf = device.alloc(arr.nbytes)
    try:
        b = Binding(buf, 0, arr.shape, (1,), "f32")
        device.write(b, arr)
        assert device._staging_size == 4096
        np.testing.assert_array_equal(device.read(b), arr)
    finally:
        buf.release()
        device._free_staging()


def test_views_only_split_captures_nothing(device):
    b = GraphBuilder()
    x = b.input("x", (2, 6))
    v = b.reshape(x, shape=(3, 4))
    b.output("y", b.relu(v))
    g = b.build()
    bound = Bound(device, g)
    try:
        view_nodes = [n for n in g.nodes if n.op == "reshape"]
        split = device.compile(SplitProgram(device, view_nodes, bound.bindings))
        assert split.graph is None and split.exec is None
        split.run()
        split.release()
    finally:
        bound.release()


def test_memory_and_describe(device):
    mem = device.memory()
    assert 0 < mem.free <= mem.total
    info = device.describe()
    assert info["name"] == device.name and info["target"].startswith(("cubin sm_", "ptx sm_"))


def test_supports_kernels_and_views_but_not_host_callbacks():
    from flare.backends.cuda.lowering import LOWERINGS, supported

    b = GraphBuilder()
    x = b.input("x", (2, 3))
    assert supported(b.relu(x)) and supported(b.transpose(x))
    assert "host" not in LOWERINGS  # host nodes run on the host, by the scheduler's design


def test_direct_construction_initialises_the_driver(emu):
    """CudaDevice calls cuInit itself: a real driver refuses cuDeviceGet before it."""
    from flare.backends.cuda.device import CudaDevice
    from flare.backends.cuda_emu.host_driver import HostDriver

    driver = HostDriver(emu.driver.library)
    assert int(driver.cuDeviceGet(0)[0]) != 0  # the stand-in enforces the order, as the driver does
    dev = CudaDevice(emu.gpu, 90, "cubin", driver=driver, name="cuda-emu:direct")
    try:
        assert driver.log.index("cuInit") < driver.log.index("cuDevicePrimaryCtxRetain")
    finally:
        dev.close()


def test_fresh_memory_is_not_zeroed(emu):
    """The stand-in, like a real driver, hands out memory with old contents: tests never rely on zeros."""
    buf = emu.alloc(64, "fresh")
    try:
        assert np.frombuffer((ctypes.c_uint8 * 64).from_address(int(buf.handle)), np.uint8).any()
    finally:
        buf.release()
