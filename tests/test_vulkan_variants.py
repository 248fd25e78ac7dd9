"""Every kernel variant (workgroup / tile sizes, backends/flare/backends/vulkan/variants.py) on lavapipe.

The conformance suite runs each op with the device's default variant; here each variant a
tuning profile may name is forced through `SplitProgram.tuning`, so the GPU variants
(several subgroups per workgroup, shared-memory combination, 256-invocation tiles) are
checked on the CPU driver too, against the NumPy reference (flare.core.reference), with odd
sizes that cross tile edges. Also: the tuned variant really is the one dispatched, a
variant the device cannot run falls back, and the kernel profile setting.
Tolerance: rtol 1e-4, atol 1e-5 (f32 sums in another order; see conformance/cases.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.backend import SplitProgram
from flare.core.graph import GraphBuilder
from flare.core.ledger import LEDGER
from flare.core.reference import evaluate

from flare.backends.vulkan import VulkanBackend, variants
from flare.backends.vulkan.testing import HandBound

PROBE = VulkanBackend.probe()
pytestmark = pytest.mark.skipif(not PROBE.usable, reason=f"Vulkan unusable here: {PROBE.reason}")
RNG = np.random.default_rng(16)


@pytest.fixture(scope="module")
def dev():
    (device,) = VulkanBackend.open_devices({})
    yield device
    device.close()


def f32(*shape):
    return RNG.uniform(-2, 2, shape).astype(np.float32)


def graphs():
    """op -> (build(b) -> out, inputs): each reaches the op's variant table."""
    return {
        "matmul": (lambda b: b.matmul(b.input("a", (2, 70, 36)), b.input("w", (67, 36)), transpose_b=True),
                   {"a": f32(2, 70, 36), "w": f32(67, 36)}),
        "conv1d": (lambda b: b.conv1d(b.input("x", (2, 3, 45)), b.input("w", (66, 3, 3)), padding=1, stride=2),
                   {"x": f32(2, 3, 45), "w": f32(66, 3, 3)}),
        "mul_mat_id": (lambda b: b.mul_mat_id(b.input("w", (3, 7, 40)), b.input("x", (2, 40)), b.input("ids", (2, 2), "i32")),
                       {"w": f32(3, 7, 40), "x": f32(2, 40), "ids": np.array([[2, 0], [1, 1]], np.int32)}),
        "softmax": (lambda b: b.softmax(b.input("x", (3, 301)), scale=0.5), {"x": f32(3, 301)}),
        "layer_norm": (lambda b: b.layer_norm(b.input("x", (2, 389))), {"x": f32(2, 389)}),
        "argmax": (lambda b: b.argmax(b.input("x", (3, 263))), {"x": RNG.integers(0, 5, (3, 263)).astype(np.float32)}),
        "top_k": (lambda b: b.top_k(b.input("x", (2, 150)), k=9), {"x": RNG.integers(0, 9, (2, 150)).astype(np.float32)}),
        "sum": (lambda b: b.op("sum", b.input("x", (2, 259, 3)), axis=1), {"x": f32(2, 259, 3)}),
    }


CASES = [(op, name) for op in graphs() for name in variants.names(op)]


@pytest.mark.parametrize("op,variant", CASES, ids=[f"{o}-{v}" for o, v in CASES])
def test_variant_matches_reference(dev, op, variant):
    build, inputs = graphs()[op]
    b = GraphBuilder()
    b.output("out", build(b))
    graph = b.build()
    want = evaluate(graph, inputs)[0]["out"]
    before = LEDGER.snapshot().count(dev.name)
    with HandBound(dev, graph, gap=1) as hb:
        hb.write_leaves(inputs)
        split = dev.compile(SplitProgram(dev, graph.nodes, hb.bindings, tuning={op: variant}))
        try:
            v = variants.TABLES[op][variant]
            want_spec = (v.wg,) if variants.TABLES[op] is variants.ROWS else v.spec()
            if variants.fits(v, dev.info):  # the tuned variant is what runs
                assert any(d.spec[5:5 + len(want_spec)] == want_spec for d in split.dispatches), [d.spec for d in split.dispatches]
            split.run()
            got = hb.outputs()["out"]
        finally:
            split.release()
    assert LEDGER.snapshot().count(dev.name) == before
    if want.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_mul_mat_id_with_many_pairs_runs_tiled_per_expert(profile):
    """33 tokens x 2 slots over 4 experts: the tiled kernel (z = expert), including an
    expert nobody routes to and ids out of range (clamped), on both profiles' tiles."""
    ids = RNG.integers(0, 3, (33, 2)).astype(np.int32)
    ids[0, 0], ids[1, 1] = 7, -2  # clamped to the last / first expert; expert 3 otherwise unused
    inputs = {"w": f32(4, 67, 20), "x": f32(33, 20), "ids": ids}
    b = GraphBuilder()
    b.output("out", b.mul_mat_id(b.input("w", (4, 67, 20)), b.input("x", (33, 20)), b.input("ids", (33, 2), "i32")))
    graph = b.build()
    want = np.einsum("tsnk,tk->tsn", inputs["w"].astype(np.float64)[np.clip(ids, 0, 3)], inputs["x"].astype(np.float64))
    (device,) = VulkanBackend.open_devices({"kernel_profile": profile})
    try:
        with HandBound(device, graph, gap=1) as hb:
            got = hb.run(inputs)["out"]
            assert [d.shader for d in hb.split.dispatches] == ["matmul"]
    finally:
        device.close()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_lstm_runs_the_whole_recurrence_in_one_dispatch(profile):
    """17 steps over 2 batch rows, H = 40 (not a power of two): one lstm.comp dispatch, the
    private-rows variant on the CPU-driver profile and the subgroup variant on the GPU one."""
    T, B, H = 17, 2, 40
    inputs = {"x": f32(T, B, 4 * H), "w": f32(4 * H, H) / np.float32(np.sqrt(H)), "h0": f32(B, H), "c0": f32(B, H)}
    b = GraphBuilder()
    b.output("out", b.lstm(*(b.input(k, v.shape) for k, v in inputs.items())))
    graph = b.build()
    want = evaluate(graph, inputs)[0]["out"]
    (device,) = VulkanBackend.open_devices({"kernel_profile": profile})
    try:
        with HandBound(device, graph, gap=1) as hb:
            got = hb.run(inputs)["out"]
            (d,) = hb.split.dispatches
            assert d.shader == "lstm" and d.spec[0] == (1 if profile == "cpu" else 0) and d.groups == (B, 1, 1)
    finally:
        device.close()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_unknown_or_unrunnable_variant_falls_back_to_the_default(dev):
    big = variants.Tile(4096, 64, 64, 16, 1, 1)
    assert not variants.fits(big, dev.info)
    assert variants.pick("matmul", {"matmul": "no-such"}, dev) == variants.TABLES["matmul"][variants.default("matmul", dev)]
    assert variants.pick("softmax", {"softmax": "wg32"}, dev) == variants.ROWS["wg32"]


def test_kernel_variants_name_the_default_first(dev):
    assert dev.kernel_variants("matmul")[0] == variants.default("matmul", dev)
    assert set(dev.kernel_variants("softmax")) == set(variants.ROWS)
    assert dev.kernel_variants("add") == ()


def test_kernel_profile_config_and_errors():
    (gpu,) = VulkanBackend.open_devices({"kernel_profile": "gpu"})
    try:
        assert gpu.kernel_profile == "gpu" and gpu.describe()["kernel_profile"] == "gpu"
        assert variants.default("softmax", gpu) == variants.DEFAULT_GPU["rows"]
    finally:
        gpu.close()
    with pytest.raises(ValueError, match="kernel profile"):
        VulkanBackend.open_devices({"kernel_profile": "tpu"})
